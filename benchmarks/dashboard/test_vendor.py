"""Tests of the dashboard vendoring (``vendor.py``): synthetic npm tarballs, no network."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vendor

CDN_JS = "https://cdn.example.invalid/lib/1.0/lib.min.js"
CDN_CSS = "https://cdn.example.invalid/lib/1.0/lib.min.css"
JS = b"window.lib = 1;\n"
CSS = b"body { color: red }\n"
FONT = b"\x00font"

PAGE = f"""<html><head>
<script src="{CDN_JS}" integrity="sha256-x" crossorigin="anonymous" onerror="js_load_failure()"></script>
<link rel="stylesheet" href="{CDN_CSS}" integrity="sha256-y" crossorigin="anonymous">
<script src="asv.js"></script>
</head><body><a href="https://example.invalid/">a link stays</a></body></html>
"""


def _tarball(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def _sha512(data: bytes) -> str:
    return "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode()


@pytest.fixture
def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path, bytes]:
    """A cache holding lib@1.0's tarball, a lock pinning it, and a published page."""
    cache = tmp_path / "cache"
    cache.mkdir()
    data = _tarball({"dist/lib.min.js": JS, "dist/lib.min.css": CSS, "fonts/f.woff": FONT})
    (cache / "lib-1.0.tgz").write_bytes(data)
    monkeypatch.setattr(vendor, "CACHE", cache)
    sha = {n: hashlib.sha256(b).hexdigest() for n, b in [("dist/lib.min.js", JS)]}
    css_sha = {
        "dist/lib.min.css": hashlib.sha256(CSS).hexdigest(),
        "fonts/f.woff": hashlib.sha256(FONT).hexdigest(),
    }
    common = {"package": "lib", "version": "1.0", "integrity": _sha512(data)}
    lock = tmp_path / "lock.json"
    lock.write_text(
        json.dumps(
            {
                "assets": [
                    {"url": CDN_JS, "file": "dist/lib.min.js", "sha256": sha, **common},
                    {
                        "url": CDN_CSS,
                        "file": "dist/lib.min.css",
                        "companions": ["fonts/f.woff"],
                        "sha256": css_sha,
                        **common,
                    },
                ]
            }
        )
    )
    html = tmp_path / "html"
    html.mkdir()
    (html / "index.html").write_text(PAGE)
    return html, lock, data


def test_publish_copies_pinned_files_and_points_the_page_at_them(
    setup: tuple[Path, Path, bytes],
) -> None:
    html, lock, _ = setup
    written = vendor.publish(html, lock)
    page = (html / "index.html").read_text()
    assert vendor.external_refs(page) == []
    assert '<script src="vendor/lib-1.0/dist/lib.min.js" onerror="js_load_failure()">' in page
    assert '<link rel="stylesheet" href="vendor/lib-1.0/dist/lib.min.css">' in page
    assert '<script src="asv.js"></script>' in page
    assert 'href="https://example.invalid/"' in page  # links to pages are not assets
    assert (html / "vendor/lib-1.0/dist/lib.min.js").read_bytes() == JS
    assert (html / "vendor/lib-1.0/fonts/f.woff").read_bytes() == FONT
    assert len(written) == 3
    # Publishing again (the page already rewritten) changes nothing and still succeeds.
    vendor.publish(html, lock)
    assert (html / "index.html").read_text() == page


def test_a_tampered_tarball_is_refused(setup: tuple[Path, Path, bytes]) -> None:
    html, lock, data = setup
    (vendor.CACHE / "lib-1.0.tgz").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(vendor.VendorError, match=r"lib-1.0.tgz: sha512 .* differs"):
        vendor.publish(html, lock)
    assert vendor.external_refs((html / "index.html").read_text()) == [CDN_JS, CDN_CSS]


def test_a_file_hash_mismatch_is_refused(setup: tuple[Path, Path, bytes]) -> None:
    html, lock, _ = setup
    doc = json.loads(lock.read_text())
    doc["assets"][0]["sha256"]["dist/lib.min.js"] = "0" * 64
    lock.write_text(json.dumps(doc))
    with pytest.raises(vendor.VendorError, match=r"lib@1.0/dist/lib.min.js: sha256"):
        vendor.publish(html, lock)


def test_an_unpinned_cdn_asset_is_an_error_naming_it(setup: tuple[Path, Path, bytes]) -> None:
    html, lock, _ = setup
    extra = '<script src="https://cdn.example.invalid/other.js"></script>'
    (html / "index.html").write_text(PAGE.replace("</head>", extra + "</head>"))
    with pytest.raises(vendor.VendorError, match=r"other\.js, which .*lock\.json does not pin"):
        vendor.publish(html, lock)


def test_the_lock_covers_every_cdn_asset_of_the_installed_asv() -> None:
    asv = pytest.importorskip("asv")
    template = Path(asv.__file__).parent / "www" / "index.html"
    refs = vendor.external_refs(template.read_text())
    assert refs, "asv's index.html has no CDN asset: the vendoring is no longer needed"
    assert sorted(set(refs) - set(vendor.load_lock())) == []
