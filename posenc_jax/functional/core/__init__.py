"""The attention and the contract every encoding fills.

``hooks`` (the contract: the hook protocols, the optional fast forms, the context every hook
receives), ``registry``, ``positions``, ``relative`` (distances), ``masks``, ``attention``
(the pipeline and its ``implementation=`` dispatch), ``blockwise`` (the same attention in
tiles), ``normalizers`` (softmax and the fixes for the blind spot) and ``cache``. Nothing here
imports an encoding.
"""
