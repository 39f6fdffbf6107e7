// Emulation stand-in for <cuda_bf16.h>: the emulated __nv_bfloat16 lives in cuda_emu.h (see there).
#pragma once
#include "../cuda_emu.h"
