#!/bin/sh
# The cmake flags that pick llama.cpp's CPU instruction sets for `make llamacpp`: on x86,
# this CPU's (from /proc/cpuinfo) except AMX, whose kernels crash on the Sapphire Rapids
# VMs tokenmill is tested on (SIGSEGV in ggml_backend_amx_mul_mat at the first decode
# with -march=native); on other architectures -march=native.
case "$(uname -m)" in
x86_64 | amd64)
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    out="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    for pair in sse4_2:SSE42 avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI \
        avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        cpu=${pair%%:*}
        opt=${pair##*:}
        case "$flags" in
        *" $cpu "*) out="$out -DGGML_$opt=ON" ;;
        *) out="$out -DGGML_$opt=OFF" ;;
        esac
    done
    echo "$out"
    ;;
*) echo "-DGGML_NATIVE=ON" ;;
esac
