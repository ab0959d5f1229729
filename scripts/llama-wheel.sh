#!/usr/bin/env bash
# Build (once) and print the path of a portable llama-cpp-python wheel.
#
# llama.cpp's default build uses -march=native, and a VM's CPU may advertise instructions (AMX)
# that it cannot run: the server then dies on its first request with an illegal instruction. This
# builds for the AVX2/FMA level every x86-64 machine of our kind has, with AVX-512 and AMX off.
# The wheel is cached under ${EVENTLIGHT_WHEEL_CACHE:-~/.cache/eventlight/wheels}/<flags hash>/,
# so a second venv (or CI run) on the same machine installs it in seconds; a new machine builds it
# (6–11 minutes on 2 cores).
#
#   scripts/llama-wheel.sh PYTHON VERSION    e.g. scripts/llama-wheel.sh .venv/bin/python 0.3.36
set -euo pipefail
python=${1:?usage: llama-wheel.sh PYTHON VERSION}
version=${2:?usage: llama-wheel.sh PYTHON VERSION}

flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
flags+=" -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
flags+=" -DLLAVA_BUILD=OFF"
if [ "$(uname -m)" != "x86_64" ]; then flags="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"; fi

key=$(printf '%s %s %s' "$version" "$flags" "$("$python" -c 'import sys; print(sys.implementation.cache_tag)')" \
  | sha256sum | cut -c1-12)
dir="${EVENTLIGHT_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/eventlight/wheels}/llama-$key"
wheel=$(ls "$dir"/llama_cpp_python-"$version"-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  echo "Building llama-cpp-python $version for a portable CPU level (6–11 minutes on 2 cores, once)…" >&2
  mkdir -p "$dir"
  tmp=$(mktemp -d "$dir/.build.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  CMAKE_ARGS="$flags" "$python" -m pip wheel --quiet --no-deps --no-cache-dir --no-binary llama-cpp-python \
    -w "$tmp" "llama-cpp-python==$version" >&2
  mv "$tmp"/llama_cpp_python-*.whl "$dir"/
  printf '%s\n' "$flags" > "$dir/FLAGS"
  wheel=$(ls "$dir"/llama_cpp_python-"$version"-*.whl | head -n1)
fi
printf '%s\n' "$wheel"
