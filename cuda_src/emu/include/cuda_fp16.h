// Emulation stand-in for <cuda_fp16.h>: the emulated __half lives in cuda_emu.h (see there).
#pragma once
#include "../cuda_emu.h"
