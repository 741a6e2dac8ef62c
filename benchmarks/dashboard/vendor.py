"""Make asv's published dashboard self-contained: its scripts and styles served from beside it.

asv's ``index.html`` loads jQuery, flot, Bootstrap, stupidtable and blueimp-md5 from public
CDNs, so without internet access it shows only an error page. ``vendor(html_dir)`` replaces
every external ``<script src>`` and stylesheet ``<link href>`` of the published HTML by a copy
under ``html_dir/vendor/<package>-<version>/``, taken from the npm package pinned in
``assets.lock.json`` (by version, the tarball's sha512 and each file's sha256). Tarballs are
fetched once with ``npm pack`` into ``benchmarks/.dashboard-cache/`` and verified on every use;
a hash mismatch, an asset asv asks for that the lock does not cover, or an external reference
left after the rewrite is an error. ``lock`` refreshes the hashes after the lock is edited.

Usage::

    python benchmarks/dashboard/vendor.py publish benchmarks/html
    python benchmarks/dashboard/vendor.py lock
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
LOCK = HERE / "assets.lock.json"
CACHE = HERE.parent / ".dashboard-cache"
VENDOR = "vendor"

_TAG = re.compile(r"<(script|link)\b[^>]*>(?:\s*</script>)?", re.IGNORECASE)
_ATTR = re.compile(r'([\w-]+)\s*=\s*"([^"]*)"')


class VendorError(RuntimeError):
    """The dashboard could not be made self-contained (the message says what and how to fix)."""


@dataclass(frozen=True)
class Asset:
    """One external URL of asv's HTML and the npm package file that replaces it."""

    url: str
    package: str
    version: str
    file: str
    companions: tuple[str, ...]
    integrity: str
    sha256: dict[str, str]
    note: str

    @property
    def folder(self) -> str:
        return f"{VENDOR}/{self.package}-{self.version}"

    @property
    def local(self) -> str:
        return f"{self.folder}/{self.file}"

    @property
    def tarball(self) -> Path:
        return CACHE / f"{self.package}-{self.version}.tgz"


def _asset(entry: dict[str, Any]) -> Asset:
    return Asset(
        url=entry["url"],
        package=entry["package"],
        version=entry["version"],
        file=entry["file"],
        companions=tuple(entry.get("companions", [])),
        integrity=entry.get("integrity", ""),
        sha256=dict(entry.get("sha256", {})),
        note=entry.get("note", ""),
    )


def load_lock(path: Path = LOCK) -> dict[str, Asset]:
    """The lock file's assets by the URL asv's HTML names."""
    try:
        entries: list[dict[str, Any]] = json.loads(path.read_text())["assets"]
        return {e["url"]: _asset(e) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise VendorError(f"{path} is not a readable asset lock ({err!r})") from err


def _sri(data: bytes, algo: str = "sha512") -> str:
    return f"{algo}-" + base64.b64encode(hashlib.new(algo, data).digest()).decode()


def _npm_pack(package: str, version: str) -> Path:
    """Fetch ``package@version`` into the cache with ``npm pack``; the tarball's path."""
    CACHE.mkdir(parents=True, exist_ok=True)
    npm = shutil.which("npm")
    if npm is None:
        raise VendorError(
            f"{package}@{version} is not in {CACHE} and npm is not on PATH: install Node.js/npm "
            "(Debian: apt-get install npm) or copy the tarball into the cache"
        )
    cmd = [npm, "pack", f"{package}@{version}", "--pack-destination", str(CACHE), "--silent"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise VendorError(f"npm pack {package}@{version} failed: {out.stderr.strip()[-500:]}")
    path = CACHE / f"{package}-{version}.tgz"
    if not path.exists():
        raise VendorError(f"npm pack {package}@{version} did not write {path}")
    return path


def _tarball(asset: Asset, *, fetch: bool = True) -> bytes:
    """The asset's tarball bytes, fetched if absent, checked against the lock's sha512."""
    path = asset.tarball
    if not path.exists():
        if not fetch:
            raise VendorError(f"{path} is missing")
        _npm_pack(asset.package, asset.version)
    data = path.read_bytes()
    if asset.integrity and _sri(data) != asset.integrity:
        raise VendorError(
            f"{path}: sha512 {_sri(data)} differs from {asset.integrity} pinned in the lock; "
            "delete the file to fetch it again, or run `vendor.py lock` if the pin is wrong"
        )
    return data


def _members(asset: Asset, data: bytes) -> dict[str, bytes]:
    """The asset's main file and companions (paths in the package) -> their bytes."""
    wanted = (asset.file, *asset.companions)
    found: dict[str, bytes] = {}
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for name in wanted:
            try:
                member = tar.extractfile(f"package/{name}")
            except KeyError:
                member = None
            if member is None:
                raise VendorError(
                    f"{asset.package}@{asset.version} has no file {name!r}: fix the lock entry "
                    f"for {asset.url}"
                )
            found[name] = member.read()
    return found


def verified_files(asset: Asset) -> dict[str, bytes]:
    """The asset's files, each checked against its pinned sha256."""
    files = _members(asset, _tarball(asset))
    for name, body in files.items():
        want = asset.sha256.get(name)
        got = hashlib.sha256(body).hexdigest()
        if want != got:
            raise VendorError(
                f"{asset.package}@{asset.version}/{name}: sha256 {got} but the lock pins {want}; "
                "run `vendor.py lock` only if the new version is intended"
            )
    return files


def external_refs(page: str) -> list[str]:
    """The external (http/https or protocol-relative) script and stylesheet URLs of ``page``."""
    refs = []
    for match in _TAG.finditer(page):
        attrs = dict(_ATTR.findall(match.group(0)))
        url = attrs.get("src") if match.group(1).lower() == "script" else attrs.get("href")
        if url and re.match(r"^(https?:)?//", url):
            refs.append(html.unescape(url))
    return refs


def _rewrite(page: str, assets: dict[str, Asset], where: Path, lock: Path) -> str:
    def replace(match: re.Match[str]) -> str:
        tag = match.group(0)
        attrs = dict(_ATTR.findall(tag))
        kind = match.group(1).lower()
        url = html.unescape(attrs.get("src" if kind == "script" else "href", ""))
        if url not in assets:
            return tag
        local = assets[url].local
        if kind == "script":
            onerror = f' onerror="{attrs["onerror"]}"' if "onerror" in attrs else ""
            return f'<script src="{local}"{onerror}></script>'
        return f'<link rel="stylesheet" href="{local}">'

    missing = [u for u in external_refs(page) if u not in assets]
    if missing:
        raise VendorError(
            f"{where} loads {', '.join(missing)}, which {lock} does not pin: add an entry "
            "(url, npm package, version, file) to the lock and run `vendor.py lock`"
        )
    return _TAG.sub(replace, page)


def publish(html_dir: Path, lock: Path = LOCK) -> list[Path]:
    """Copy the pinned assets into ``html_dir/vendor`` and point every HTML page at them.

    Guarantees on return: no ``*.html`` of ``html_dir`` loads a script or stylesheet from the
    network, and every file copied matches its pinned sha256. Returns the files written.
    """
    assets = load_lock(lock)
    pages = sorted(html_dir.glob("*.html"))
    if not pages:
        raise VendorError(f"{html_dir} has no HTML page: run `asv publish` first")
    used = {u for p in pages for u in external_refs(p.read_text()) if u in assets}
    written: list[Path] = []
    for url in sorted(used):
        asset = assets[url]
        for name, body in verified_files(asset).items():
            dest = html_dir / asset.folder / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(body)
            written.append(dest)
    for page in pages:
        text = page.read_text()
        new = _rewrite(text, assets, page, lock)
        if new != text:
            page.write_text(new)
        left = external_refs(new)
        if left:
            raise VendorError(f"{page} still loads {', '.join(left)} after the rewrite")
    return written


def relock(lock: Path = LOCK) -> None:
    """Re-fetch every package of the lock and write its tarball sha512 and file sha256s."""
    doc = json.loads(lock.read_text())
    fetched: dict[tuple[str, str], bytes] = {}
    for entry in doc["assets"]:
        asset = _asset({**entry, "integrity": "", "sha256": {}})
        key = (asset.package, asset.version)
        if key not in fetched:
            asset.tarball.unlink(missing_ok=True)
            fetched[key] = _npm_pack(asset.package, asset.version).read_bytes()
        data = fetched[key]
        entry["integrity"] = _sri(data)
        files = _members(asset, data)
        entry["sha256"] = {n: hashlib.sha256(b).hexdigest() for n, b in sorted(files.items())}
        print(f"{asset.package}@{asset.version} {asset.file}: {entry['integrity']}")
    lock.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pub = sub.add_parser("publish", help="vendor the assets of a published asv dashboard")
    pub.add_argument("html_dir", type=Path)
    sub.add_parser("lock", help="re-fetch the lock's packages and rewrite their hashes")
    args = parser.parse_args(argv)
    try:
        if args.command == "lock":
            relock()
        else:
            files = publish(args.html_dir)
            print(f"dashboard assets: {len(files)} files under {args.html_dir / VENDOR}")
    except VendorError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
