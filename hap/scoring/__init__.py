"""Capture and head scores (docs/method.md §1-§6): the prompt rows' attention recomputed from q and k (`capture`), each
head's sink share, dispersion, visual share, PAQ and class (`heads`), and the PAQ-weighted fusion of a cut's maps into
token scores and the top-k selection (`fusion`). Pure tensor functions: no model, no method."""
