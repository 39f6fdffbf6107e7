"""bias_add on the CPU: ``x [R, C] + b [C]`` as a new array (NumPy's broadcast add, memory-bound)."""


def bias_add(x, b):
    return x + b  # [R, C]
