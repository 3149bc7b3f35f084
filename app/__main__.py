"""`python -m app`: serve the HAP demo on 127.0.0.1."""

from app.app import main

main()
