#!/usr/bin/env bash
# Builds llama.cpp's CUDA benches (llama-bench, llama-batched-bench) for one GPU architecture,
# from the llama.cpp vendored in the llama-cpp-python sdist, with NVIDIA's PyPI wheels as the
# toolkit: the GPU peer of the issues' measurements, built on a machine without a GPU.
#
#   pip download --no-deps -d wheels "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-runtime==13.0.*" \
#       "nvidia-cuda-cccl==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" "nvidia-cublas==13.0.*"
#   pip download --no-deps --no-binary :all: -d . llama-cpp-python==0.3.36
#   benchmarks/build_llama_cpp_cuda.sh wheels llama_cpp_python-0.3.36.tar.gz OUT_DIR [ARCH]
#
# OUT_DIR gets bin/ (the two benches, static apart from libcudart/libcublas, which the GPU
# machine's torch wheels provide: run them with those wheels' lib folders on LD_LIBRARY_PATH).
# The toolkit version must be the one the GPU machine's torch was built with (13.0 for the
# torch 2.11 cu130 wheels), so the benches load its libraries.
set -euo pipefail
wheels=$1 sdist=$2 out=$3 arch=${4:-90}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

pip install -q --no-deps --target "$work/toolkit" "$wheels"/nvidia_*.whl
cuda=$work/toolkit/nvidia/cu13
(cd "$cuda/lib" && for lib in cudart cublas cublasLt; do ln -sf "lib$lib.so.13" "lib$lib.so"; done)
ln -sfn lib "$cuda/lib64"

tar -xzf "$sdist" -C "$work"
source_dir=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)

# No OpenMP and no OpenSSL: the GPU machine's image need not have libgomp or libssl, and the
# benches use neither (the CPU backend only holds what is not offloaded; nothing is downloaded).
PATH=$cuda/bin:$PATH cmake -S "$source_dir" -B "$work/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" -DGGML_CUDA_NO_VMM=ON \
    -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
    -DCUDAToolkit_ROOT="$cuda" -DCMAKE_CUDA_COMPILER="$cuda/bin/nvcc"
PATH=$cuda/bin:$PATH ninja -C "$work/build" llama-bench llama-batched-bench
mkdir -p "$out/bin"
cp "$work/build/bin/llama-bench" "$work/build/bin/llama-batched-bench" "$out/bin/"
strip "$out/bin"/*
echo "built: $(ls "$out/bin")"
