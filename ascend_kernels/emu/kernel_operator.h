// Stand-in for CANN's "kernel_operator.h" when the Ascend C kernels are compiled for x86 (tests).
// It provides the subset of the Ascend C API that dflash's kernels use, written from the public
// API documentation, and checks the hardware rules listed in ascend_kernels/README.md.
#pragma once

#include "emu_copy.h"
#include "emu_runtime.h"
#include "emu_tensor.h"
#include "emu_types.h"
#include "emu_vector.h"
