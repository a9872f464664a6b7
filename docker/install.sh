#!/usr/bin/env bash
# The image's install steps in one place: the Dockerfile runs them, tests/unit/test_docker.py runs them in a fresh
# virtual environment.
#   install.sh torch SPEC                torch first, pinned (e.g. torch==2.13.0: PyPI's Linux CUDA build)
#   install.sh deps PYPROJECT [EXTRAS]   the dependencies listed in pyproject.toml, plus its extras (default: hf);
#                                        not the package, so this layer survives source edits; an installed torch
#                                        is held at its version (a dependency must not swap the CUDA build)
#   install.sh package SRC               the package itself, without dependencies
#   install.sh reqs PYPROJECT [EXTRAS]   print the requirements that `deps` installs, one a line (build.sh
#                                        collects their wheels for a build without a package index)
# PIP (default: python -m pip) and PIP_ARGS (e.g. --dry-run) change how pip is called; PYTHON (default python3)
# reads pyproject.toml (it needs tomllib: 3.11 or later).
set -euo pipefail
PIP=${PIP:-python -m pip}
PIP_ARGS=${PIP_ARGS:-}

# The dependencies of pyproject.toml plus those of its extras (comma-separated), gasloc's own self-references left out.
requirements() {
  ${PYTHON:-python3} - "$1" "$2" <<'PY'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
reqs = list(project["dependencies"])
for extra in filter(None, sys.argv[2].split(",")):
    reqs += [r for r in project["optional-dependencies"][extra] if not r.startswith("gasloc")]
print("\n".join(reqs))
PY
}

case "${1:-}" in
  torch)
    [ -n "${2:-}" ] || { echo "install.sh: give a torch requirement, e.g. torch==2.13.0" >&2; exit 2; }
    # shellcheck disable=SC2086
    $PIP install $PIP_ARGS "$2"
    ;;
  reqs)
    [ -f "${2:-}" ] || { echo "install.sh: pyproject file '${2:-}' not found" >&2; exit 2; }
    requirements "$2" "${3:-hf}"
    ;;
  deps)
    [ -f "${2:-}" ] || { echo "install.sh: pyproject file '${2:-}' not found" >&2; exit 2; }
    reqs=$(requirements "$2" "${3:-hf}")
    mapfile -t req_list <<<"$reqs"
    hold=()
    if torch_version=$(python -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null); then
      constraints=$(mktemp)
      echo "torch==$torch_version" >"$constraints"
      hold=(--constraint "$constraints")
    fi
    # shellcheck disable=SC2086  # PIP and PIP_ARGS are word lists on purpose
    $PIP install $PIP_ARGS "${hold[@]}" "${req_list[@]}"
    ;;
  package)
    [ -d "${2:-}" ] || { echo "install.sh: source directory '${2:-}' not found" >&2; exit 2; }
    # shellcheck disable=SC2086
    $PIP install $PIP_ARGS --no-deps "$2"
    ;;
  *)
    echo "usage: install.sh torch SPEC | deps PYPROJECT [EXTRAS] | package SRC | reqs PYPROJECT [EXTRAS]" >&2
    exit 2
    ;;
esac
