"""Review findings on the app's plumbing: the sweep cache key and the Blocks' temporary files."""

from PIL import Image

from app.pipeline import image_key


def test_image_key_tells_apart_images_with_the_same_bytes():
    """A 20x10 and a 10x20 image of the same bytes (or the same bytes read in another mode) are different images:
    they must not share a sweep cache entry."""
    data = bytes(range(200)) * 3
    wide, tall = Image.frombytes("RGB", (20, 10), data), Image.frombytes("RGB", (10, 20), data)
    grey = Image.frombytes("L", (30, 20), data)
    assert len({image_key(wide), image_key(tall), image_key(grey)}) == 3
    assert image_key(wide) == image_key(Image.frombytes("RGB", (20, 10), data))


def test_the_blocks_delete_their_temporary_files():
    """Uploads and figures must not pile up on disk for the server's life (a Space runs for weeks)."""
    from app.app import build_demo

    demo = build_demo()
    every, age = demo.delete_cache
    assert 0 < every <= age <= 7 * 86400
