#!/usr/bin/env python3
"""Checks the layering of the top-level CMakeLists.txt by compiling probes against each
layer's include folder (ckptfs_layer: symbolic links to the src/ folders and public headers
the layer may see).

The layers come from a manifest that tests/CMakeLists.txt generates from the build: one
`layer NAME FOLDER` line per target that compiles against a folder under the layer root, in
the order the targets were declared (bottom up), and the include directories and definitions
each compiles with. What a layer may see is what its folder holds; which layer an item (a
src/ folder or a public header) belongs to is the first layer, in declaration order, whose
folder holds it. Nothing here names a layer.

Each probe is a source file in a scratch folder, run through the compiler's preprocessor with
the layer's include directories and definitions (--compile: parsed as well). For every layer
A and every layer B that owns items:
- A == B: a probe including every header of A's own items resolves every include it reaches;
- B's items that A's folder holds: a probe including all their headers does the same;
- B's items that A's folder does not hold: for each, a probe including one of its headers
  fails, and fails only because the compiler cannot find that header: the one error is
  "<probe>:<line>:<col>: fatal error: <header>: No such file or directory" on the probe's
  include line. Any other outcome (it resolves, or fails for another reason, another
  header included) fails the check.

A pair (A, B) is allowed when A sees all of B's items, forbidden when it sees none, partial
when it sees some (a front end that sees a layer's public header but not its sources).

--plant runs the check on planted faults instead and exits 0 only if the check catches each:
in a copy of the layer folders, in every layer's own folder, a header that includes a header
of a later layer it may not see; and forbidden probes that fail for another reason (each
includes a missing header of no layer before the one it checks)."""

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

PUBLIC = "ckptfs"  # the folder of public headers inside a layer folder
HEADER_SUFFIXES = (".hpp", ".h")


@dataclass
class Layer:
    name: str
    folder: Path
    includes: list = field(default_factory=list)
    defines: list = field(default_factory=list)
    sees: frozenset = frozenset()  # items: "dir/" for a src/ folder, "ckptfs/x.hpp" for a header
    owns: list = field(default_factory=list)


@dataclass
class Probe:
    layer: Layer  # compiled against this layer's folder
    owner: Layer  # the layer whose items it includes
    kind: str  # "own", "allowed" or "forbidden"
    headers: list  # include names, as written in the probe
    item: str = ""  # for a forbidden probe: the item it must not see
    prefix: str = ""  # code before the includes (the planted broken probe)


def read_manifest(path: Path) -> list:
    layers, by_name = [], {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        kind, name, value = (line.split("\t", 2) + ["", ""])[:3]
        if kind == "layer":
            by_name[name] = Layer(name, Path(value))
            layers.append(by_name[name])
        elif kind == "include" and value:
            by_name[name].includes.append(value)
        elif kind == "define" and value:
            by_name[name].defines.append(value)
        elif kind not in ("include", "define"):
            sys.exit(f"layering: {path}: unknown line {line!r}")
    if not layers:
        sys.exit(f"layering: {path} names no layer")
    return layers


def folder_items(folder: Path) -> frozenset:
    items = set()
    for entry in folder.iterdir():
        if entry.name == PUBLIC:
            items.update(f"{PUBLIC}/{h.name}" for h in entry.iterdir())
        else:
            items.add(f"{entry.name}/")
    return frozenset(items)


def item_headers(layer: Layer, item: str) -> list:
    """The include names of ITEM's headers, as found in LAYER's folder (which holds it): the
    header itself, or every header of a src/ folder."""
    if not item.endswith("/"):
        return [item]
    root = layer.folder / item
    # Subfolders too (format/torch/), through links (a planted copy links each entry).
    return sorted(f"{item}{(Path(folder) / name).relative_to(root)}"
                  for folder, _, names in os.walk(root, followlinks=True) for name in names
                  if name.endswith(HEADER_SUFFIXES))


def item_probe_header(owner: Layer, item: str) -> str:
    """The include name a forbidden probe uses for ITEM: the header itself, or the first
    header of a src/ folder (its first file where it has no header: the missing name is what
    is checked)."""
    headers = item_headers(owner, item)
    if headers:
        return headers[0]
    return f"{item}{sorted(p.name for p in (owner.folder / item).iterdir())[0]}"


def assign_owners(layers: list) -> None:
    seen = set()
    for layer in layers:
        layer.sees = folder_items(layer.folder)
        layer.owns = sorted(layer.sees - seen)
        seen |= layer.sees


def plan(layers: list) -> tuple:
    """(probes, pairs): pairs is [(A, B, class, seen items, unseen items)]."""
    probes, pairs = [], []
    owners = [b for b in layers if b.owns]
    for a in layers:
        for b in owners:
            if a is b:
                headers = [h for item in b.owns for h in item_headers(b, item)]
                if headers:
                    probes.append(Probe(a, b, "own", headers))
                continue
            seen = [i for i in b.owns if i in a.sees]
            unseen = [i for i in b.owns if i not in a.sees]
            if seen:
                headers = [h for item in seen for h in item_headers(a, item)]
                if headers:
                    probes.append(Probe(a, b, "allowed", headers))
            for item in unseen:
                probes.append(Probe(a, b, "forbidden", [item_probe_header(b, item)], item))
            cls = "allowed" if not unseen else "forbidden" if not seen else "partial"
            pairs.append((a, b, cls, seen, unseen))
    return probes, pairs


def compile_probe(probe: Probe, cxx: str, std: str, workdir: Path) -> tuple:
    """(ok, message)."""
    text = probe.prefix + "".join(f'#include "{h}"\n' for h in probe.headers)
    # The probe's name says what it checks; its folder lies outside every include folder.
    path = workdir / f"{probe.layer.name}__{probe.owner.name}__{probe.kind}.cpp"
    path.write_text(text)
    argv = [cxx, std, *STAGE, *include_flags(probe.layer), *(f"-D{d}" for d in probe.layer.defines), str(path)]
    try:
        # LC_ALL=C: the diagnostics are matched in the compiler's own words.
        res = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, "LC_ALL": "C"})
    except subprocess.TimeoutExpired:
        return False, "the compiler ran past 120 s"
    out = res.stdout + res.stderr
    if probe.kind != "forbidden":
        if res.returncode == 0:
            return True, ""
        return False, f"does not resolve in {probe.layer.name}'s folder:\n{indent(first_errors(out))}"
    if res.returncode == 0:
        return False, f"{probe.headers[0]} resolves: the folder of {probe.layer.name} holds {probe.item}"
    errors = [line for line in out.splitlines() if re.search(r"\b(fatal )?error:", line)]
    line_no = text.count("\n", 0, text.index(f'#include "{probe.headers[0]}"')) + 1
    header = re.escape(probe.headers[0])
    # GCC: "fatal error: H: No such file or directory"; Clang: "fatal error: 'H' file not found".
    want = re.compile(rf"^{re.escape(str(path))}:{line_no}:\d+: fatal error: "
                      rf"({header}: No such file or directory|'{header}' file not found)$")
    if len(errors) == 1 and want.match(errors[0]):
        return True, ""
    return False, (f"fails, but not (only) because {probe.headers[0]} is missing:\n{indent(first_errors(out))}")


IMPLICIT_INCLUDES: set = set()
# What a probe runs: the preprocessor, which resolves every include the probe reaches, the
# headers' own includes too, exactly as a compile of a source in that folder would (that is
# what a layer folder decides, and it costs a twentieth of a compile); --compile parses them
# as well (-fsyntax-only).
STAGE = ["-M", "-MF", os.devnull]


def include_flags(layer: Layer) -> list:
    """As the build passes them: the layer's folder with -I, the libraries' folders with
    -isystem, the compiler's own folders not at all (passing those reorders its search)."""
    flags, done = [], set(IMPLICIT_INCLUDES)
    for folder in layer.includes:
        if folder in done:
            continue
        done.add(folder)
        flags.append(f"-I{folder}" if Path(folder).is_relative_to(layer.folder.parent) else f"-isystem{folder}")
    return flags


def first_errors(out: str, count: int = 8) -> str:
    lines = [line for line in out.splitlines() if "error" in line] or out.splitlines()
    return "\n".join(lines[:count])


def indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def run_check(layers: list, cxx: str, std: str, jobs: int, quiet: bool = False, only=None) -> list:
    """Runs every probe (ONLY: those compiled against that layer's folder); prints the pairs;
    returns the failure lines."""
    assign_owners(layers)
    probes, pairs = plan(layers)
    if only is not None:
        probes = [p for p in probes if p.layer.name == only.name]
    failures = []
    with tempfile.TemporaryDirectory(prefix="ckptfs-layering-") as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            workdirs = []
            for i, _ in enumerate(probes):
                d = Path(tmp) / str(i)
                d.mkdir()
                workdirs.append(d)
            results = list(pool.map(lambda pw: compile_probe(pw[0], cxx, std, pw[1]), zip(probes, workdirs)))
    for probe, (ok, message) in zip(probes, results):
        if not ok:
            what = probe.item or ", ".join(probe.headers)
            failures.append(f"FAIL {probe.kind} {probe.layer.name} -> {probe.owner.name} ({what}): {message}")
    if not quiet:
        report(layers, probes, pairs)
    return failures


def report(layers, probes, pairs) -> None:
    print("layers, bottom up, and the items each owns:")
    for layer in layers:
        print(f"  {layer.name}: {' '.join(layer.owns) or '(nothing of its own)'}")
    counts = {"allowed": 0, "forbidden": 0, "partial": 0}
    order = {layer.name: i for i, layer in enumerate(layers)}
    for a, b, cls, seen, unseen in pairs:
        counts[cls] += 1
        # A layer declared later is above; one declared earlier that A may not see is beside.
        direction = "above" if order[a.name] < order[b.name] else "beside" if cls == "forbidden" else "below"
        detail = ""
        if cls == "partial":
            detail = f": sees {' '.join(seen)}; not {' '.join(unseen)}"
        print(f"  {cls:9} {a.name} includes {b.name} ({b.name} {direction}){detail}")
    kinds = {k: sum(1 for p in probes if p.kind == k) for k in ("own", "allowed", "forbidden")}
    print(f"pairs: {counts['allowed']} allowed, {counts['forbidden']} forbidden, {counts['partial']} partial; "
          f"probes: {kinds['own']} own-layer, {kinds['allowed']} that must resolve, "
          f"{kinds['forbidden']} that must fail naming their header")


# --- planted faults -------------------------------------------------------------------


def copy_layers(layers: list, layer_root: Path, into: Path) -> list:
    """LAYERS with their folders copied under INTO (links kept) and include directories
    under LAYER_ROOT pointed there."""
    shutil.copytree(layer_root, into, symlinks=True)
    copied = []
    for layer in layers:
        moved = [str(into / Path(i).relative_to(layer_root)) if Path(i).is_relative_to(layer_root) else i
                 for i in layer.includes]
        copied.append(Layer(layer.name, into / layer.folder.relative_to(layer_root), moved, list(layer.defines)))
    return copied


def plant_bad_includes(layers: list) -> list:
    """In every layer that owns a src/ folder and may not see a header of a later layer, a
    header of its own folder that includes that header. Returns [(layer, planted header, the
    header it includes)]."""
    assign_owners(layers)
    plants = []
    for i, low in enumerate(layers):
        own_dirs = [item for item in low.owns if item.endswith("/")]
        if not own_dirs:
            continue
        target = next((item_probe_header(high, item) for high in layers[i + 1:] for item in high.owns
                       if item not in low.sees), None)
        if target is None:
            continue
        # The own folder becomes a real folder of links to the sources, plus the plant.
        link = low.folder / own_dirs[0]
        source = link.resolve()
        link.unlink()
        link.mkdir()
        for entry in source.iterdir():
            (link / entry.name).symlink_to(entry)
        (link / "planted_bad_include.hpp").write_text(f'#pragma once\n#include "{target}"\n')
        plants.append((low, f"{own_dirs[0]}planted_bad_include.hpp", target))
    if not plants:
        sys.exit("layering --plant: no layer owns a src/ folder below another layer's header")
    return plants


def run_plant(layers: list, layer_root: Path, cxx: str, std: str, jobs: int) -> int:
    problems = []
    with tempfile.TemporaryDirectory(prefix="ckptfs-layering-plant-") as tmp:
        planted_layers = copy_layers(layers, layer_root, Path(tmp) / "layers")
        # Each plant is in its own layer's folder; the other layers' folders link to the
        # sources, so each layer's check sees its own plant only.
        for n, (low, planted, target) in enumerate(plant_bad_includes(planted_layers), 1):
            print(f"plant 1.{n}: {low.folder.name}/{planted} includes {target}, which {low.name} may not see")
            failures = run_check(planted_layers, cxx, std, jobs, quiet=True, only=low)
            caught = [f for f in failures if planted in f and target in f]
            for line in caught:
                print("  detected: " + "\n  ".join(line.splitlines()[:3]))
            if not caught:
                problems.append(f"plant 1.{n} not detected: no failure names {planted} and {target} "
                                f"in {low.name}; failures: {failures or 'none'}")
            elif any(planted not in f for f in failures):
                problems.append(f"plant 1.{n}: failures beyond the planted header:\n" +
                                "\n".join(f for f in failures if planted not in f))

    # Forbidden probes that include a header of no layer first: they still fail, with the
    # same kind of error, but not on the header they check; a check that took any failure
    # (or any missing header) would pass them.
    assign_owners(layers)
    probes, _ = plan(layers)
    forbidden = [p for p in probes if p.kind == "forbidden"]
    if not forbidden:
        problems.append("plant 2: there is no forbidden pair to plant in")
    else:
        for p in forbidden:
            p.prefix = '#include "planted_header_of_no_layer.hpp"\n'
        print(f"plant 2: a missing header of no layer before the include of each of the {len(forbidden)} forbidden probes")
        with tempfile.TemporaryDirectory(prefix="ckptfs-layering-plant-") as tmp:
            results = []
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                dirs = [Path(tmp) / str(i) for i in range(len(forbidden))]
                for d in dirs:
                    d.mkdir()
                results = list(pool.map(lambda pd: compile_probe(pd[0], cxx, std, pd[1]), zip(forbidden, dirs)))
        missed = [p for p, (ok, _) in zip(forbidden, results) if ok]
        print(f"  detected: {len(forbidden) - len(missed)} of {len(forbidden)} probes reported as failing for another reason")
        if missed:
            problems.append("plant 2 not detected for: " + ", ".join(f"{p.layer.name} -> {p.headers[0]}" for p in missed))

    for line in problems:
        print(f"FAIL {line}")
    if problems:
        return 1
    print("layering --plant: every planted fault was detected")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", type=Path, required=True)
    parser.add_argument("--layer-root", type=Path, required=True)
    parser.add_argument("--cxx", required=True)
    parser.add_argument("--std", default="-std=c++20")
    parser.add_argument("--implicit-includes", default="", help="the compiler's own include folders, ':'-separated")
    parser.add_argument("--jobs", type=int, default=min(4, os.cpu_count() or 1))
    parser.add_argument("--compile", action="store_true", help="parse the probes too (-fsyntax-only), not only preprocess")
    parser.add_argument("--plant", action="store_true", help="check that planted faults are detected")
    args = parser.parse_args()
    layers = read_manifest(args.manifest)
    if args.compile:
        STAGE[:] = ["-fsyntax-only"]
    IMPLICIT_INCLUDES.update(i for i in args.implicit_includes.split(":") if i)
    for layer in layers:
        if not layer.folder.is_dir():
            print(f"FAIL layer folder {layer.folder} of {layer.name} is missing (configure the build)")
            return 1
    if args.plant:
        return run_plant(layers, args.layer_root, args.cxx, args.std, args.jobs)
    failures = run_check(layers, args.cxx, args.std, args.jobs)
    for line in failures:
        print(line)
    if failures:
        print(f"layering: {len(failures)} probe(s) failed")
        return 1
    print("layering: every probe gave the expected result")
    return 0


if __name__ == "__main__":
    sys.exit(main())
