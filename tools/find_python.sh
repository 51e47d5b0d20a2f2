#!/usr/bin/env bash
# Prints the path of a working CPython interpreter, or nothing (exit 1) when there is none.
#
#   tools/find_python.sh WANT...
#
# Each WANT is a version (3.13), a command (python3.13) or a path, tried in order; the first
# that runs wins. A version or a pythonX.Y command is looked for on PATH, then among pyenv's
# installed versions ($PYENV_ROOT/versions/X.Y*/bin), so that a pyenv shim for a version that
# is installed but not selected (`pyenv: python3.13: command not found`) is not the end of it.
set -uo pipefail

runs() { "$1" -c 'import sys, venv' >/dev/null 2>&1; }

for want in "$@"; do
  version=${want#python}
  candidates=("$want")
  if [[ $version =~ ^3\.[0-9]+$ ]]; then
    candidates=("python$version")
    pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
    for dir in "$pyenv_root"/versions/"$version".*/bin "$pyenv_root"/versions/"$version"/bin; do
      [ -x "$dir/python$version" ] && candidates+=("$dir/python$version")
    done
  fi
  for candidate in "${candidates[@]}"; do
    if runs "$candidate"; then
      if [[ $candidate == */* ]]; then echo "$candidate"; else command -v "$candidate"; fi
      exit 0
    fi
  done
done
exit 1
