# Sourced by the GPU scripts (gpu_check.sh, gpu_paper_cifar100.sh): with $WHEELS set, installs its wheels and the
# project, from a clean copy of the checkout, into a temporary folder that alone goes on PYTHONPATH (models/ and
# guides/ install as bayesncl_pyro.models and bayesncl_pyro.guides, so the repository on PYTHONPATH is not enough);
# without it $PY must have the project installed. Needs $PY; run from the repository root.
# the installed project only: no repository on the path, not even as the current folder of `python -`
export PYTHONPATH= PYTHONSAFEPATH=1
export PYTHONUNBUFFERED=1  # what is printed is in the log when a run is cut short
if [ -n "${WHEELS:-}" ]; then
    SITE=$(mktemp -d)
    deps=()
    for wheel in "$WHEELS"/*.whl; do
        case $(basename "$wheel") in setuptools-*) ;; *) [ -e "$wheel" ] && deps+=("$wheel") ;; esac
    done
    PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE")
    if (( ${#deps[@]} )); then "${PIP[@]}" "${deps[@]}" || return 1; fi
    # the project itself, from a clean copy (a build/ left in the repository could add stale modules); without
    # setuptools in this python, pip builds it in isolation with the wheel folder's
    SRC=$(mktemp -d)
    cp -r pyproject.toml README.md bayesncl_pyro models guides "$SRC"/ || return 1
    "$PY" -c "import setuptools" 2>/dev/null && isolation=--no-build-isolation || isolation=
    "${PIP[@]}" --find-links "$WHEELS" $isolation "$SRC" || return 1
    export PYTHONPATH=$SITE
fi
