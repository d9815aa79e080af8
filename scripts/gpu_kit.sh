#!/usr/bin/env bash
# Maintainers' tool. Build the GPU kit: .whl/ holds exactly the wheels a bare GPU machine without network
# (Python 3.12, torch 2.11 and a long package list, but no verl) lacks for
#   python3 -m verl_prefix.tools.cli bench --preset gpu
# (docs/maintainers/gpu-check.md). Run it where pip reaches the package registry; send .whl to the GPU machine
# beside the working tree, where bench/gpu_check.sh installs it with --no-deps.
#
#   bash scripts/gpu_kit.sh [PYTHON_VERSION] [DEST]
#     PYTHON_VERSION  3.12 (default: the device's python3). Another version (e.g. 3.11) fetches the same
#                     set for that interpreter, to test the kit's completeness on a CPU machine.
#     DEST            where the wheels go (default .whl; its old *.whl are removed first).
#   MAX_MB=56 (env)   fail when the wheels total more than this many MiB: working tree + carry <= 64 MiB.
#
# The set: every distribution that `import verl_prefix.tools.bench.runner, verl_prefix.tools.cli`, verl's
# FSDPEngineWithLMHead and a smoke bench run load (sys.modules, mapped to owners through RECORD files),
# minus those the device image already holds at a usable version. Versions are the ones in this repo's
# .venv (checked below when .venv exists), so the device runs what the CPU tests ran.
set -euo pipefail
cd "$(dirname "$0")/.."

PYVER="${1:-3.12}"
DEST="${2:-.whl}"
MAX_MB="${MAX_MB:-56}"
PY="${PYTHON:-python3}"
PYTAG="cp${PYVER/./}"

WHEELS=(
  # verl itself and the pins that the device's own versions break
  verl==0.9.1
  transformers==5.10.4 # verl 0.9.1 needs >=5.5.3,<5.11; the device has 5.17.0
  tokenizers==0.22.2   # transformers 5.10.4 checks tokenizers<=0.23.0 at import; the device has 0.23.2
  peft==0.21.2         # verl imports peft; the device's release is built against its transformers 5.17
  typing_extensions==4.16.0 # pydantic 2.14.4 needs >=4.16.0; the device's version is not known
  tensordict==0.10.0   # verl: <=0.10.0, !=0.9.0
  pyvers==0.1.0
  torchdata==0.11.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  hydra-core==1.3.8
  omegaconf==2.3.1
  codetiming==1.4.0
  # verl's v1 trainer stack, imported by verl_prefix (trainer mode) and verl.protocol
  TransferQueue==0.1.11
  pyzmq==27.3.0
  msgspec==0.23.0
  fastapi==0.165.0
  starlette==1.10.0
  uvicorn==0.54.0
  opentelemetry-api==1.45.2 # fastapi imports it
  pydantic==2.14.4
  pydantic_core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  sniffio==1.3.1
  cachetools==8.0.2
  orjson==3.13.0
  # what `import ray` loads (ray itself comes stripped, below)
  jsonschema==4.26.0
  jsonschema-specifications==2025.9.1
  referencing==0.37.0
  rpds-py==2026.9.1
  colorful==0.5.8
)
# GPU-only: flash-linear-attention's Triton kernels (no CPU .venv can import them: no triton there, so they
# are not checked against it). With them transformers runs Qwen3.5/Qwen3-Next's gated delta-nets on fla, and
# the schedule serves fla's chunked rule (docs/design.md, tests/schedule/test_recurrent_cuda.py).
GPU_ONLY=(fla-core==0.5.2 flash-linear-attention==0.5.2 einops==0.8.2)
# prefix_torchtitan (the gpu preset's torchtitan cell): torchtitan 0.3.0 and what it imports, the versions
# scripts/setup.sh pins (triton comes with the device's CUDA torch)
TITAN=(torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 tyro==1.0.17 docstring_parser==0.18.0
  typeguard==4.6.1)
SDISTS=(antlr4-python3-runtime==4.9.3) # hydra/omegaconf pin 4.9.*, published as an sdist only: built here
RAY=ray==2.60.0

PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done

# Same versions as the repo's .venv (what the CPU tests ran), where it exists.
if [ -x .venv/bin/python ]; then
  .venv/bin/python - "${WHEELS[@]}" "${SDISTS[@]}" "$RAY" <<'EOF'
import importlib.metadata as md
import sys

bad = []
for spec in sys.argv[1:]:
    name, version = spec.split("==")
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have != version:
        bad.append(f"{name}: kit {version}, .venv {have}")
if bad:
    sys.exit("gpu_kit: versions differ from .venv:\n  " + "\n  ".join(bad))
EOF
fi

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

pip_download() {
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    "${PLATFORMS[@]}" -d "$1" "${@:2}"
}

echo "gpu_kit: downloading ${#WHEELS[@]} wheels for CPython $PYVER into $DEST"
pip_download "$DEST" "${WHEELS[@]}"
echo "gpu_kit: downloading the GPU-only kernels: ${GPU_ONLY[*]}"
pip_download "$DEST" "${GPU_ONLY[@]}"
echo "gpu_kit: downloading torchtitan for prefix_torchtitan: ${TITAN[*]}"
pip_download "$DEST" "${TITAN[@]}"
echo "gpu_kit: building ${SDISTS[*]} (pure Python)"
"$PY" -m pip wheel --quiet --no-deps --no-cache-dir -w "$DEST" "${SDISTS[@]}"

echo "gpu_kit: downloading $RAY and stripping it"
pip_download "$WORK" "$RAY"
src="$(ls "$WORK"/ray-*.whl)"
"$PY" - "$src" "$DEST/$(basename "$src")" <<'EOF'
"""Copy a ray wheel without what only a running cluster needs, and fix its RECORD.

The bench builds both verl engines in one process and never starts a Ray cluster, but verl
(verl/protocol.py) and TransferQueue import ray and decorate classes with ray.remote. Dropped: the Java
jars, the GCS server and raylet executables, the dashboard's web client.
"""

import sys
import zipfile

DROP_DIRS = ("ray/jars/", "ray/dashboard/client/build/")
DROP_FILES = ("ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet")


def dropped(name: str) -> bool:
    return name.startswith(DROP_DIRS) or name in DROP_FILES


src, dst = sys.argv[1], sys.argv[2]
kept = gone = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    names = zin.namelist()
    missing = [f for f in DROP_FILES if f not in names]
    if missing:
        sys.exit(f"gpu_kit: {src} has no {missing}: check what to strip for this ray release")
    for info in zin.infolist():
        if dropped(info.filename):
            gone += info.file_size
            continue
        data = zin.read(info)
        if info.filename.count("/") == 1 and info.filename.endswith(".dist-info/RECORD"):  # ray's own
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not dropped(line.split(",", 1)[0])).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        kept += 1
print(f"gpu_kit: ray stripped of {gone / 2**20:.0f} MiB (uncompressed), {kept} files kept")
EOF

# One wheel per distribution, every one for this interpreter: two versions of one stop the whole install.
"$PY" - "$DEST" "$PYTAG" <<'EOF'
import collections
import pathlib
import sys

dest, pytag = pathlib.Path(sys.argv[1]), sys.argv[2]  # pytag: cp312
names = collections.Counter()
for whl in sorted(dest.glob("*.whl")):
    name, _version, *_, py, abi, plat = whl.stem.split("-")
    names[name.lower().replace("_", "-")] += 1
    tags = py.split(".")
    pure = abi == "none" and any(t in ("py3", f"py{pytag[2:]}", pytag) for t in tags)
    stable = abi == "abi3" and any(t.startswith("cp3") and int(t[3:]) <= int(pytag[3:]) for t in tags)
    native = abi == pytag and pytag in tags
    if not (pure or stable or native) or not (plat == "any" or plat.endswith("x86_64")):
        sys.exit(f"gpu_kit: {whl.name} is not for {pytag} on x86-64 Linux")
dups = [n for n, c in names.items() if c > 1]
if dups:
    sys.exit(f"gpu_kit: more than one wheel of {dups}")
EOF

mib() { awk -v b="$1" 'BEGIN { printf "%.1f", b / 1048576 }'; }
for whl in "$DEST"/*.whl; do
  printf '  %6s MiB  %s\n' "$(mib "$(wc -c <"$whl")")" "$(basename "$whl")"
done
total=$(cat "$DEST"/*.whl | wc -c)
count=$(ls "$DEST"/*.whl | wc -l)
echo "gpu_kit: $count wheels, $(mib "$total") MiB in $DEST (limit $MAX_MB MiB)"
if [ "$total" -gt $((MAX_MB * 1048576)) ]; then
  echo "gpu_kit: error: the kit is over $MAX_MB MiB; with the working tree it must stay under 64 MiB" >&2
  exit 1
fi
if [ "$DEST" = .whl ] && git rev-parse --git-dir >/dev/null 2>&1; then
  # what a `run` call sends besides the carried kit: tracked and untracked-but-not-ignored files
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
  echo "gpu_kit: working tree $(mib "$tree") MiB + kit = $(mib $((tree + total))) MiB (limit 64 MiB)"
  if [ $((tree + total)) -gt $((64 * 1048576)) ]; then
    echo "gpu_kit: error: working tree + kit over 64 MiB" >&2
    exit 1
  fi
fi
