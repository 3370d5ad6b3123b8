"""The encodings, one module each: its mathematics, its hook, its config, its registration.

Every module in this folder is imported with the package, and importing a module registers its
encoding, so adding an encoding is adding one file here.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
