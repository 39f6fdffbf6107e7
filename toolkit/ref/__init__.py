"""NumPy reference of every op: the specification. Plain and obviously correct, never optimised.

Shape legend (used in every op module): ``B`` sequences, ``T`` tokens (per sequence, or flattened),
``D`` hidden, ``H`` query heads, ``Hkv`` KV heads, ``hd`` head dim, ``S`` cache length, ``E`` experts,
``A`` (=k) active experts per token, ``I`` expert intermediate size, ``V`` vocabulary.
"""
