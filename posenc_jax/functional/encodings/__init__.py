"""The encodings, one module each: its mathematics, its hook, its config, its registration.

Every module in this folder is imported with the package, and importing a module registers its
encoding, so adding an encoding is adding one file here. A few modules hold only a hook that
declares its forms without a name of its own (``rope_decoupled``, ``score_scale``: hooks the
Hugging Face loader builds).
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
