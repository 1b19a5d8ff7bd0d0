#!/usr/bin/env bash
# Build native/build/libanima_vae.so: our anima_vae.cpp compiled with the stable-diffusion.cpp sources
# vendored in the PyPI sdist stable-diffusion-cpp-python==0.4.7 (ggml tinyBLAS on, -march=native).
# Idempotent: does nothing when the library is newer than native/anima_vae.cpp and native/CMakeLists.txt.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
NATIVE="$REPO/native"
BUILD="$NATIVE/build"
LIB="$BUILD/libanima_vae.so"
SDIST_VERSION="0.4.7"
SRC_ROOT="$BUILD/sdist"
SDCPP_DIR="$SRC_ROOT/stable_diffusion_cpp_python-$SDIST_VERSION/vendor/stable-diffusion.cpp"

if [[ -f "$LIB" && "$LIB" -nt "$NATIVE/anima_vae.cpp" && "$LIB" -nt "$NATIVE/CMakeLists.txt" ]]; then
    echo "up to date: $LIB"
    exit 0
fi

mkdir -p "$SRC_ROOT"
if [[ ! -d "$SDCPP_DIR" ]]; then
    "${PYTHON:-python3}" -m pip download --no-binary :all: --no-deps --dest "$SRC_ROOT" \
        "stable-diffusion-cpp-python==$SDIST_VERSION"
    tar -xzf "$SRC_ROOT/stable_diffusion_cpp_python-$SDIST_VERSION.tar.gz" -C "$SRC_ROOT"
fi

start=$(date +%s)
cmake -S "$NATIVE" -B "$BUILD/cmake" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release \
    -DSDCPP_DIR="$SDCPP_DIR" \
    -DGGML_NATIVE=ON \
    -DGGML_LLAMAFILE=ON \
    -DGGML_OPENMP=ON \
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF
cmake --build "$BUILD/cmake" --target anima_vae -j "$(nproc)"
# a new file moved into place: processes that have the old library mapped keep a valid copy
cp "$BUILD/cmake/libanima_vae.so" "$LIB.tmp" && mv -f "$LIB.tmp" "$LIB"
echo "built $LIB in $(( $(date +%s) - start )) s"
