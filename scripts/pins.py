"""Check or rewrite every package's pinned dependencies from ``[tool.embshard.pins]``.

The root ``pyproject.toml`` declares, once: the torch range, the FBGEMM version that goes with it
and the FBGEMM build behind each extra (``cpu`` -> ``fbgemm-gpu-cpu``, ``cuda`` -> ``fbgemm-gpu``),
the packages bottom to top, and which package requires FBGEMM itself. From that, each package's
``pyproject.toml`` must carry exactly:

- ``torch<range>`` in ``[project] dependencies``;
- ``embshard-<lower>>=X.Y,<...`` for every package below it, the range being "same minor
  version" of that package's own version (``0.1.x`` -> ``>=0.1,<0.2``; ``1.2.x`` -> ``>=1.2,<2``);
- for the FBGEMM package: extras ``cpu = ["fbgemm-gpu-cpu==V"]``, ``cuda = ["fbgemm-gpu==V"]``;
  for the packages above it: extras forwarding to it (``cpu = ["embshard-kernels[cpu]<range>"]``);
  for the packages below it: no FBGEMM requirement and no ``cpu`` / ``cuda`` extras.

Other requirements (numpy, ...) are left as they are. Each package keeps its own version.

    python scripts/pins.py --check    # exit 1 and list the differences (run by `nox -s lint`)
    python scripts/pins.py --write    # rewrite the package files (then run `uv lock`)
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    if match is None:
        raise ValueError(f"cannot read a project name in requirement {requirement!r}")
    return canonical(match.group(1))


def compatible_range(version: str) -> str:
    """``>=X.Y,<X.(Y+1)`` before 1.0, ``>=X.Y,<(X+1)`` from 1.0 on."""
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]]
    major, minor = [*parts, 0, 0][:2]
    upper = f"0.{minor + 1}" if major == 0 else f"{major + 1}"
    return f">={major}.{minor},<{upper}"


@dataclass(frozen=True)
class Pins:
    torch: str
    fbgemm: str
    fbgemm_extras: dict[str, str]
    packages: list[str]
    fbgemm_package: str

    @classmethod
    def load(cls, root: Path = ROOT) -> Pins:
        data = tomllib.loads((root / "pyproject.toml").read_text())
        try:
            pins = data["tool"]["embshard"]["pins"]
            loaded = cls(
                torch=pins["torch"],
                fbgemm=pins["fbgemm"],
                fbgemm_extras=dict(pins["fbgemm-extras"]),
                packages=list(pins["packages"]),
                fbgemm_package=pins["fbgemm-package"],
            )
        except KeyError as missing:
            raise SystemExit(
                f"pins: {root / 'pyproject.toml'} lacks [tool.embshard.pins] key {missing}; "
                "see the docstring of scripts/pins.py for the expected table"
            ) from None
        if loaded.fbgemm_package not in loaded.packages:
            raise SystemExit(
                f"pins: fbgemm-package {loaded.fbgemm_package!r} is not one of packages "
                f"{loaded.packages}"
            )
        return loaded


def package_file(name: str, root: Path = ROOT) -> Path:
    return root / "packages" / name / "pyproject.toml"


def expected(pins: Pins, name: str, versions: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The managed ``dependencies`` entries (in order) and managed extras of package ``name``."""
    index = pins.packages.index(name)
    deps = [f"torch{pins.torch}"]
    deps += [f"{lower}{compatible_range(versions[lower])}" for lower in pins.packages[:index]]
    extras: dict[str, str] = {}
    fbgemm_index = pins.packages.index(pins.fbgemm_package)
    if index == fbgemm_index:
        extras = {extra: f"{dist}{pins.fbgemm}" for extra, dist in pins.fbgemm_extras.items()}
    elif index > fbgemm_index:
        kernel_range = compatible_range(versions[pins.fbgemm_package])
        extras = {
            extra: f"{pins.fbgemm_package}[{extra}]{kernel_range}" for extra in pins.fbgemm_extras
        }
    return deps, extras


# ---- reading and rewriting TOML arrays without losing comments ------------------------------


def _array_span(text: str, start: int) -> tuple[int, int]:
    """Index of the ``[`` at/after ``start`` and of its matching ``]`` (strings, comments aware)."""
    open_at = text.index("[", start)
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "#":
            i = text.index("\n", i) if "\n" in text[i:] else len(text)
            continue
        if ch in "\"'":
            end = text.index(ch, i + 1)
            i = end + 1
            continue
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth == 0:
                return open_at, i
        i += 1
    raise ValueError("unterminated array")


def _items(body: str) -> list[tuple[list[str], str]]:
    """Array items as (comment lines above it, requirement string)."""
    items: list[tuple[list[str], str]] = []
    comments: list[str] = []
    for match in re.finditer(r"#[^\n]*|\"([^\"]*)\"|'([^']*)'", body):
        if match.group(0).startswith("#"):
            comments.append(match.group(0))
        else:
            value = match.group(1) if match.group(1) is not None else match.group(2)
            items.append((comments, value))
            comments = []
    if comments:
        items.append((comments, ""))
    return items


def _render(items: list[tuple[list[str], str]], indent: str = "    ") -> str:
    lines = ["["]
    for comments, value in items:
        lines += [f"{indent}{c}" for c in comments]
        if value:
            lines.append(f'{indent}"{value}",')
    lines.append("]")
    return "\n".join(lines)


def _section_bounds(text: str, header: str) -> tuple[int, int] | None:
    """Start (after the header line) and end of table ``[header]`` in ``text``."""
    match = re.search(rf"^\[{re.escape(header)}\]\s*$", text, re.M)
    if match is None:
        return None
    following = re.search(r"^\[", text[match.end() :], re.M)
    end = match.end() + following.start() if following else len(text)
    return match.end(), end


def _key_array(text: str, header: str, key: str) -> tuple[int, int] | None:
    bounds = _section_bounds(text, header)
    if bounds is None:
        return None
    start, end = bounds
    match = re.search(rf"^{re.escape(key)}\s*=\s*", text[start:end], re.M)
    if match is None:
        return None
    return _array_span(text, start + match.end())


def rewrite(text: str, deps: list[str], extras: dict[str, str], managed_names: set[str]) -> str:
    """``text`` with the managed requirements replaced, other entries and comments kept."""
    span = _key_array(text, "project", "dependencies")
    if span is None:
        raise SystemExit("pins: [project] has no dependencies array")
    open_at, close_at = span
    items = _items(text[open_at + 1 : close_at])
    wanted = {requirement_name(r): r for r in deps}
    new_items: list[tuple[list[str], str]] = []
    seen: set[str] = set()
    for comments, value in items:
        name = requirement_name(value) if value else ""
        if name in wanted:
            new_items.append((comments, wanted[name]))
            seen.add(name)
        elif name in managed_names:
            continue  # a managed requirement this package must not have
        else:
            new_items.append((comments, value))
    missing: list[tuple[list[str], str]] = [
        ([], r) for r in deps if requirement_name(r) not in seen
    ]
    # Managed entries first, in the pins' order, then the others in their own order.
    order = {requirement_name(r): i for i, r in enumerate(deps)}
    managed_items = sorted(
        [it for it in new_items if it[1] and requirement_name(it[1]) in order] + missing,
        key=lambda it: order[requirement_name(it[1])],
    )
    other_items = [it for it in new_items if not (it[1] and requirement_name(it[1]) in order)]
    text = text[:open_at] + _render(managed_items + other_items) + text[close_at + 1 :]

    header = "project.optional-dependencies"
    for extra in ("cpu", "cuda"):
        bounds = _section_bounds(text, header)
        span = _key_array(text, header, extra)
        if extra not in extras:
            if span is not None:
                line_start = text.rfind("\n", 0, span[0]) + 1
                line_end = text.find("\n", span[1])
                text = text[:line_start] + text[line_end + 1 :]
            continue
        line = f'["{extras[extra]}"]'
        if span is not None:
            text = text[: span[0]] + line + text[span[1] + 1 :]
        elif bounds is not None:
            end = _section_bounds(text, header)[1]  # type: ignore[index]
            # insert before the blank line(s) that separate the next table
            while end > 1 and text[end - 1] == "\n" and text[end - 2] == "\n":
                end -= 1
            text = text[:end] + f"{extra} = {line}\n" + text[end:]
        else:
            dep_close = _key_array(text, "project", "dependencies")[1]  # type: ignore[index]
            after = text.find("\n", dep_close) + 1
            table = "\n[project.optional-dependencies]\n"
            table += "# Exactly one of these: both FBGEMM builds install into fbgemm_gpu/.\n"
            table += "".join(f'{e} = ["{extras[e]}"]\n' for e in ("cpu", "cuda") if e in extras)
            text = text[:after] + table + text[after:]
            break
    return text


def current_requirements(data: dict) -> tuple[list[str], dict[str, list[str]]]:
    project = data.get("project", {})
    return list(project.get("dependencies", [])), dict(project.get("optional-dependencies", {}))


def problems_of(pins: Pins, name: str, data: dict, versions: dict[str, str]) -> list[str]:
    deps, extras = expected(pins, name, versions)
    managed_names = managed(pins)
    current_deps, current_extras = current_requirements(data)
    found = [r for r in current_deps if requirement_name(r) in managed_names]
    problems = []
    if found != deps:
        problems.append(f"dependencies: has {found}, pins want {deps}")
    for extra in ("cpu", "cuda"):
        want = [extras[extra]] if extra in extras else None
        have = current_extras.get(extra)
        if have != want:
            problems.append(f"extra [{extra}]: has {have}, pins want {want}")
    for extra, reqs in current_extras.items():
        if extra in ("cpu", "cuda"):
            continue
        stray = [r for r in reqs if requirement_name(r) in managed_names]
        if stray:
            problems.append(f"extra [{extra}] carries pinned projects {stray}: move them")
    return problems


def managed(pins: Pins) -> set[str]:
    return {"torch", *map(canonical, pins.fbgemm_extras.values()), *map(canonical, pins.packages)}


def check_conflicts(pins: Pins, root_data: dict) -> list[str]:
    """The root must declare the cpu / cuda extras as conflicts for every package carrying them."""
    declared = root_data.get("tool", {}).get("uv", {}).get("conflicts", [])
    sets = [{(c.get("package"), c.get("extra")) for c in group} for group in declared]
    start = pins.packages.index(pins.fbgemm_package)
    problems = []
    for name in pins.packages[start:]:
        want = {(name, extra) for extra in pins.fbgemm_extras}
        if want not in sets:
            problems.append(
                f"pyproject.toml [tool.uv] conflicts: add {sorted(want)} as one group "
                f"(the FBGEMM builds of {name} must never install together)"
            )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="report differences, exit 1 if any")
    mode.add_argument("--write", action="store_true", help="rewrite the package pyproject files")
    args = parser.parse_args(argv)

    pins = Pins.load()
    files = {name: package_file(name) for name in pins.packages}
    for name, path in files.items():
        if not path.exists():
            raise SystemExit(f"pins: {path} does not exist (package {name} in the pins table)")
    data = {name: tomllib.loads(path.read_text()) for name, path in files.items()}
    versions = {name: data[name]["project"]["version"] for name in pins.packages}

    failures = check_conflicts(pins, tomllib.loads((ROOT / "pyproject.toml").read_text()))
    for name, path in files.items():
        problems = problems_of(pins, name, data[name], versions)
        if not problems:
            continue
        if args.write:
            deps, extras = expected(pins, name, versions)
            text = rewrite(path.read_text(), deps, extras, managed(pins))
            path.write_text(text)
            left = problems_of(pins, name, tomllib.loads(text), versions)
            if left:
                failures += [f"{path.relative_to(ROOT)}: {p} (could not rewrite)" for p in left]
            else:
                print(f"pins: rewrote {path.relative_to(ROOT)}")
        else:
            failures += [f"{path.relative_to(ROOT)}: {p}" for p in problems]

    if failures:
        print("pins: packages disagree with [tool.embshard.pins] in pyproject.toml:")
        for line in failures:
            print(f"  {line}")
        if args.check:
            print("fix: python scripts/pins.py --write && uv lock")
        return 1
    if args.check:
        print(
            f"pins: {len(files)} packages agree (torch{pins.torch}, FBGEMM {pins.fbgemm}, "
            + ", ".join(f"{n} {versions[n]}" for n in pins.packages)
            + ")"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
