// The elementwise functions shared with the CPU (scoria_math.cuh, written once for both
// sides). Until that header exists on this branch, a stand-in keeps the kernels building.
#pragma once

#if __has_include("scoria_math.cuh")
#include "scoria_math.cuh"
#else
#include "scoria_math_fallback.cuh"
#endif
