#!/usr/bin/env bash
# The first minutes of a lent GPU machine, prepared on this one.
#
#   bash bench/device_session.sh prepare        # here, with PyPI: wheels into .device/ (git-ignored)
#   bash bench/device_session.sh run [ARGS...]  # there, offline: install them, then bench/gpu.py ARGS
#
# The GPU machine's image has torch, triton, lightning and transformers but not hydra-core,
# omegaconf or antlr4 (an sdist: wheeled here), and reaches no index. `prepare` puts those
# three and this project's own wheel (and yappi's, for bench/gpu_profile.py, where PyPI has
# it) in .device/wheels, leaving the rest of .device alone; carry `.device` to the machine.
# `run` installs them with --no-index --no-deps --target .device/site (the image's packages
# are left alone), puts that on PYTHONPATH and runs `python bench/gpu.py` with ARGS
# (default `--out docs/gpu/<device>-<date>.json`; e.g. `--extras --only ablations --out ...`).
# bench/gpu.py runs its steps outside the checkout, so the wheel is what they import.
# `run --quick --out /tmp/gpu.json` rehearses it on a CPU machine. HETERMOE_DEVICE_DIR
# names another folder than .device.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${HETERMOE_DEVICE_DIR:-.device}
WHEELS=$DIR/wheels
SITE=$DIR/site

case "${1:-}" in
prepare)
  rm -rf "$WHEELS" "$SITE"  # the rest of $DIR (a script of the session's own) stays
  mkdir -p "$WHEELS"
  version() { python -c "import importlib.metadata as m; print(m.version('$1'))"; }
  python -m pip download -q --no-deps -d "$WHEELS" "hydra-core==$(version hydra-core)" \
    "omegaconf==$(version omegaconf)"
  python -m pip wheel -q --no-deps -w "$WHEELS" "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
  python -m pip wheel -q --no-deps -w "$WHEELS" .
  # yappi profiles every thread (bench/gpu_profile.py); the machine's Python is 3.12. Optional.
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" yappi \
    || echo "(no yappi wheel: bench/gpu_profile.py falls back to cProfile)" >&2
  ls -l "$WHEELS"
  ;;
run)
  shift
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "no wheels in $WHEELS: run 'bash bench/device_session.sh prepare' first and carry $DIR" >&2
    exit 2
  fi
  rm -rf "$SITE"
  wheels=$(ls "$WHEELS"/*.whl | grep -v /yappi-)
  python -m pip install -q --no-index --no-deps --target "$SITE" $wheels
  # yappi's wheel is for the machine's Python (3.12): elsewhere the profile takes cProfile
  python -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/yappi-*.whl 2>/dev/null \
    || echo "(yappi not installed here: bench/gpu_profile.py takes cProfile)" >&2
  site=$(cd "$SITE" && pwd)
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  if [[ " $* " != *" --out "* ]]; then
    kind=$(cd /tmp && python -c "
import torch
from lightning_hetermoe.cluster.devices import match_device_name
name = torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'
print(match_device_name(name) or name.lower().replace(' ', '_'))")
    set -- "$@" --out "docs/gpu/${kind}-$(date +%F).json"
  fi
  python bench/gpu.py "$@"
  ;;
*)
  echo "usage: bash bench/device_session.sh prepare | run [bench/gpu.py arguments]" >&2
  exit 2
  ;;
esac
