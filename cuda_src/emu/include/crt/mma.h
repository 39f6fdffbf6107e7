// Emulation stand-in: present so that `__has_include(<crt/mma.h>)` holds; the emulated WMMA is ../mma.h.
#pragma once
