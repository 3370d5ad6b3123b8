"""Saving and restoring models and optimizers with orbax-checkpoint.

:class:`Checkpointer` keeps the last N checkpoints of an NNX model and, when given, its
optimizer (parameters, optimizer moments and step, RNG streams), so a restored model
gives identical outputs and training resumed from a checkpoint continues exactly as it
would have.

Each step is a folder of three orbax items: ``model``, ``optimizer`` (when saved) and
``meta``, a small JSON file (``<step>/meta/metadata``) that records

* ``model``: the model's ``describe()`` (a :class:`~posenc_jax.nn.Transformer`'s settings
  and encoding configs), when the model has that method;
* ``encodings``: for any model, one's own included, each of its encoding modules
  (:class:`~posenc_jax.nn.PositionEncoding`, by path: its config) and attention layers
  (:class:`~posenc_jax.nn.MultiHeadAttention`: its heads and head size), since an encoding
  without parameters (RoPE) or another head layout leaves the arrays' shapes unchanged;
* ``config``: the dict the caller passed to ``save(..., config=...)``;
* ``arrays``: for every saved array, its path, shape, dtype and the sha256 of its bytes,
  computed on the host as it is saved.

Before :meth:`Checkpointer.restore` changes anything it checks, in order, that the step
exists; that the model's ``describe()``, its encodings and attention layers and the
``config`` it is given equal the recorded ones; that the arrays have the recorded paths, shapes and dtypes; and, after
reading them, that every array has its recorded sha256 and that none holds NaN or inf
(a run that had diverged; ``allow_nonfinite=True`` loads it to look at). A mismatch is a
:class:`CheckpointError`, a damaged step a :class:`DamagedCheckpointError` (both are
``ValueError``\\ s), each one line naming the step and the directory. Without an explicit
step, a damaged newest step is skipped with a warning and the newest intact one restored;
a newest step with NaN or inf is an error, not skipped.

:func:`check_finite` is the same NaN and inf check for a model in hand (after training, or
after copying weights in by hand), naming the arrays.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import threading
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from posenc_jax.functional.core.validation import check_count
from posenc_jax.nn.attention import MultiHeadAttention
from posenc_jax.nn.encoding import PositionEncoding

__all__ = ["CheckpointError", "Checkpointer", "DamagedCheckpointError", "check_finite"]

_FORMAT = 1  # of the meta item; a later layout would read older ones by this number
_LISTED = 4  # differences named in an error; the rest are counted


class CheckpointError(ValueError):
    """A checkpoint that does not fit the restore asked of it: no such step, another model or
    config, other arrays."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint step whose files cannot be read or whose arrays fail their recorded sha256."""

    def __init__(self, where: str, reason: str):
        super().__init__(f"{where} is damaged: {reason}")
        self.reason = reason


def _path_key(key) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    return str(key)


def _path_name(path) -> str:
    return "/".join(_path_key(key) for key in path)


def _arrays(tree) -> dict:
    """``{"blocks/0/mlp_in/kernel": array, ...}`` for the leaves of a pure-dict state."""
    return {_path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _is_key(x) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _layout(tree) -> dict[str, tuple]:
    """Each array's path -> ``(shape, dtype)``; PRNG keys keep their key dtype (``key<fry>``)."""
    layout = {}
    for name, x in _arrays(tree).items():
        x = x if isinstance(x, (jax.Array, np.ndarray, np.generic)) else np.asarray(x)  # a Python number
        layout[name] = (tuple(x.shape), str(x.dtype))
    return layout


def _digests(tree) -> dict[str, str]:
    """Each array's path -> sha256 of its bytes, read back to the host (PRNG keys: their key data)."""
    digests = {}
    for name, x in _arrays(tree).items():
        data = np.ascontiguousarray(jax.device_get(jax.random.key_data(x) if _is_key(x) else x))
        digests[name] = hashlib.sha256(data.tobytes()).hexdigest()
    return digests


def _manifest(tree) -> dict[str, dict]:
    """Each array's path -> its shape, dtype and sha256: what a step records of its arrays."""
    digests = _digests(tree)
    return {
        name: {"shape": list(shape), "dtype": dtype, "sha256": digests[name]}
        for name, (shape, dtype) in _layout(tree).items()
    }


def _nonfinite(tree) -> tuple[list[str], int]:
    """(``"path (k NaN, j inf of n)"`` for each floating array of ``tree`` holding NaN or inf, the number of
    floating arrays). Each array is reduced where it lives; only the counts come to the host."""
    floating = {}
    for name, x in _arrays(tree).items():
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                "check_finite reads concrete arrays; call it outside jit (on a model after training or loading, "
                "not inside a step)"
            )
        xp = jnp if isinstance(x, jax.Array) else np
        dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)  # a Python number in a pure dict
        if not _is_key(x) and jnp.issubdtype(dtype, jnp.inexact):
            floating[name] = (xp.isnan(x).sum(), xp.isinf(x).sum(), np.size(x))
    found = []
    for name, (nan, inf, size) in jax.device_get(floating).items():
        if nan or inf:
            counts = [f"{n} {kind}" for n, kind in ((int(nan), "NaN"), (int(inf), "inf")) if n]
            found.append(f"{name} ({', '.join(counts)} of {size})")
    return found, len(floating)


def check_finite(model, *, what: str = "the model") -> None:
    """Refuses a model (or optimizer, ``nnx.State`` or pytree of arrays) whose arrays hold NaN or inf,
    naming each such array's path and its count of NaN and inf values.

    A NaN or inf parameter makes every output it reaches NaN, and the attention cannot say where it
    came from (its inputs are checked, its parameters are not: checking them in every call would
    cost every call). Call this where weights arrive: after training, after copying a checkpoint's
    weights in by hand (:meth:`Checkpointer.restore` runs it on what it loads). It reads values,
    so it runs outside ``jit``.

    Args:
      model: an ``nnx.Module`` (its whole state), an ``nnx.State`` or a pytree of arrays.
      what: how the message names it.

    Raises:
      ValueError: some floating array holds NaN or inf; the message lists a few of them.
      TypeError: called inside ``jit`` (on traced arrays).

    Example:
      >>> from posenc_jax.nn import Transformer
      >>> model = Transformer(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=32,
      ...                     encoding="rope", rngs=nnx.Rngs(0))
      >>> check_finite(model)  # nothing to say
      >>> model.head.bias[...] = model.head.bias[...].at[0].set(jnp.nan)
      >>> check_finite(model)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      ValueError: the model holds NaN or inf in 1 of ... arrays: head/bias (1 NaN of 8); ...
    """
    if isinstance(model, nnx.Module):
        model = nnx.state(model)
    if isinstance(model, nnx.State):
        model = nnx.to_pure_dict(model)
    found, total = _nonfinite(model)
    if found:
        raise ValueError(
            f"{what} holds NaN or inf in {len(found)} of {total} arrays: {_listed(found)}; they come from a run "
            f"that diverged or weights loaded from elsewhere: restore an earlier checkpoint, or train again with "
            f"a lower learning rate"
        )


def _listed(differences: list[str]) -> str:
    more = len(differences) - _LISTED
    return "; ".join(differences[:_LISTED]) + (f"; and {more} more" if more > 0 else "")


def _as_json(value, what: str):
    """``value`` as it reads back from JSON (tuples become lists), or a ValueError naming ``what``."""
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{what} must be a JSON-serialisable dict (strings, numbers, booleans, lists, dicts): {error}"
        ) from None


@contextlib.contextmanager
def _quiet_orbax():
    """Silences orbax's own logging (absl's logger) while a step is read or saved: a damaged step makes it
    log pages (file contents, TensorStore errors) where absl logs at INFO or WARNING, and what
    went wrong is already in the one-line error or warning :class:`Checkpointer` gives."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _save_failure(path: pathlib.Path, error: Exception) -> str:
    """One line for a failed save: the path, the OS error found in ``error`` (or its first line), the fix."""
    number, cause = None, error
    while cause is not None and number is None:
        number = cause.errno if isinstance(cause, OSError) else None
        cause = cause.__cause__ or cause.__context__
    found = re.search(r"os_error_code='(\d+)'", str(error))  # TensorStore's words for an OS error
    number = number or (int(found.group(1)) if found else None)
    what = os.strerror(number) if number else _first_line(error)
    fix = "free space on its disk" if number == errno.ENOSPC else "fix that"
    return f"cannot save {path} ({what}); {fix}, then save again (the steps saved before are kept)"


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


class Checkpointer:
    """An orbax ``CheckpointManager`` for a model (and its optimizer), keeping the last ``max_to_keep``
    steps; each step records the model's settings, the caller's config and a sha256 per array.

    Example:
      >>> import tempfile, optax
      >>> from posenc_jax.nn import Transformer
      >>> model = Transformer(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=32,
      ...                     encoding="rope", rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> ckpt = Checkpointer(tempfile.mkdtemp(), max_to_keep=2)
      >>> ckpt.save(10, model, optimizer, config={"run": "demo"})
      >>> ckpt.latest_step()
      10
      >>> fresh = Transformer(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=32,
      ...                     encoding="rope", rngs=nnx.Rngs(1))
      >>> ckpt.restore(fresh)  # the model alone, from a checkpoint with its optimizer
      10
      >>> other = Transformer(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=32,
      ...                     encoding="alibi", rngs=nnx.Rngs(1))
      >>> ckpt.restore(other)  # doctest: +ELLIPSIS
      Traceback (most recent call last):
      ...
      posenc_jax.checkpoint.CheckpointError: step 10 in ... another model: encodings=[...] there, ['ALiBi...] here; ...
    """

    def __init__(self, directory, *, max_to_keep: int = 3, process_local: bool = False):
        """``process_local``: in a job of several JAX processes (``jax.distributed``), this
        process saves and restores its own arrays alone, without the others (each host of a
        benchmark run trains its own models); by default every process takes part in each
        save, as orbax does for arrays sharded over all the processes' devices."""
        check_count("max_to_keep", max_to_keep, 1)
        self.directory = pathlib.Path(directory).absolute()
        existing = next(p for p in (self.directory, *self.directory.parents) if p.exists())
        if not existing.is_dir():
            raise ValueError(
                f"directory {self.directory}: {existing} is a file, not a folder; give a folder for the "
                f"checkpoints (one that does not exist yet is created)"
            )
        self.process_local = bool(process_local)
        extra = {"create": True}
        if process_local:
            me = jax.process_index()
            only_me = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
            # Saved synchronously: orbax's asynchronous save waits on keys of the job's coordination service
            # named by a per-process count of saves, which processes saving apart from one another share.
            extra = {"multiprocessing_options": only_me, "create": False, "enable_async_checkpointing": False}
            self.directory.mkdir(parents=True, exist_ok=True)  # orbax creates it only for all processes together
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, **extra)
        )

    @staticmethod
    def _state(model, optimizer) -> dict:
        state = {"model": nnx.to_pure_dict(nnx.state(model))}
        if optimizer is not None:
            state["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
        return state

    @staticmethod
    def _description(model):
        # A model that describes its settings (Transformer.describe()) has them recorded with each checkpoint.
        describe = getattr(model, "describe", None)
        return _as_json(describe(), "the model's describe()") if callable(describe) else None

    @staticmethod
    def _encodings(model) -> dict[str, str]:
        """Each encoding module of ``model`` (its config's repr) and attention layer (its heads and head
        size), by path: what restoring into another model would change without changing an array's shape."""
        found = {}
        # nnx.iter_modules is newer flax's name; the floor (0.12.0) has only the method.
        modules = nnx.iter_modules(model) if hasattr(nnx, "iter_modules") else model.iter_modules()
        for path, module in modules:
            name = "/".join(map(str, path)) or "the model"
            if isinstance(module, PositionEncoding):
                found[name] = repr(module.config)
            elif isinstance(module, MultiHeadAttention):
                found[name] = (
                    f"MultiHeadAttention(num_heads={module.num_heads}, num_kv_heads={module.num_kv_heads}, "
                    f"head_dim={module.head_dim})"
                )
        return dict(sorted(found.items()))

    def save(
        self, step: int, model: nnx.Module, optimizer: nnx.Optimizer | None = None, *, config: Mapping | None = None
    ) -> None:
        """Saves the model (and optimizer) at ``step`` and waits until it is on disk.

        ``config``: a JSON-serialisable dict recorded with the step (say, the run's settings);
        ``restore(..., config=...)`` then refuses a checkpoint saved with another one. Saving at
        or before the newest saved step replaces that step and drops the later ones: they belong
        to the run that restoring an earlier step abandoned (orbax alone would skip the save).
        A save that fails (a full disk) is a :class:`CheckpointError` naming the step's path and
        the OS error, and orbax's unfinished temporary folder is removed.
        """
        _check_step(step)
        if config is not None and not isinstance(config, Mapping):
            raise ValueError(f"config must be a JSON-serialisable dict, got {type(config).__name__}: {config!r}")
        meta = {
            "format": _FORMAT,
            "model": self._description(model),
            "encodings": self._encodings(model),
            "config": None if config is None else _as_json(dict(config), "config"),
        }
        state = self._state(model, optimizer)
        if self.process_local:  # orbax writes host-local device arrays only as a part of global ones
            state = jax.device_get(state)
        meta["arrays"] = {item: _manifest(tree) for item, tree in state.items()}
        for stale in [s for s in self.all_steps() if s >= step]:
            self.manager.delete(stale)
        items = {item: ocp.args.StandardSave(tree) for item, tree in state.items()}
        running = set(threading.enumerate())
        with _quiet_orbax():  # a full disk makes orbax log pages of tracebacks before it raises
            try:
                self.manager.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))
                self.manager.wait_until_finished()
            except Exception as error:  # whatever orbax raises (an OSError, TensorStore's ValueError)
                # The other items' writer threads go on after the first fails: let them end, then
                # remove the unfinished step.
                for thread in set(threading.enumerate()) - running:
                    if type(thread).__name__ == "_SignalingThread":
                        with contextlib.suppress(Exception):  # its join raises its own failure again
                            thread.join(timeout=60)
                for unfinished in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                    shutil.rmtree(unfinished, ignore_errors=True)
                raise CheckpointError(_save_failure(self.directory / str(step), error)) from None

    def latest_step(self) -> int | None:
        """The newest saved step, or None; not yet verified (``restore`` verifies, and falls back)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def close(self) -> None:
        self.manager.close()

    def restore(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer | None = None,
        step: int | None = None,
        *,
        config: Mapping | None = None,
        allow_nonfinite: bool = False,
    ) -> int:
        """Loads the checkpoint at ``step`` into ``model`` (and ``optimizer``) in place; returns the step.

        Without ``step``, the newest intact step: damaged newer ones are skipped with a
        warning naming them. The model alone restores from a checkpoint saved with its
        optimizer. ``config``, when given, must equal the one saved with the step. Nothing
        changes unless every check passes (see the module's docstring); a step whose arrays
        hold NaN or inf is refused, naming them, unless ``allow_nonfinite`` (to look at a
        diverged run's weights).
        """
        steps = self.all_steps()
        if step is not None:
            _check_step(step)
            if step not in steps:
                there = f"its steps are {steps}" if steps else "it holds no checkpoints"
                raise CheckpointError(f"no step {step} in {self.directory}; {there}")
            self._restore_step(step, model, optimizer, config, allow_nonfinite)
            return step
        if not steps:
            raise CheckpointError(f"no checkpoint in {self.directory}")
        damaged = []
        for candidate in reversed(steps):
            try:
                self._restore_step(candidate, model, optimizer, config, allow_nonfinite)
            except DamagedCheckpointError as error:
                damaged.append((candidate, error.reason))
                continue
            if damaged:
                skipped = ", ".join(str(s) for s, _ in damaged)
                reasons = "; ".join(f"{s}: {reason}" for s, reason in damaged)
                warnings.warn(
                    f"skipped damaged checkpoint step{'s' if len(damaged) > 1 else ''} {skipped} in "
                    f"{self.directory} ({reasons}); restored step {candidate}",
                    stacklevel=2,
                )
            return candidate
        names = "; ".join(f"step {s} ({reason})" for s, reason in damaged)
        raise CheckpointError(f"no intact checkpoint in {self.directory}: {names}; delete the folder to start over")

    def _restore_step(self, step: int, model, optimizer, config, allow_nonfinite: bool) -> None:
        """Checks step ``step`` against the model, optimizer and config, reads and verifies its
        arrays, and only then loads them."""
        meta = self._read_meta(step)
        self._check_settings(step, meta, model, optimizer, config)
        target = self._state(model, optimizer)
        for item, tree in target.items():
            self._check_layout(step, item, meta["arrays"][item], tree)
        restored = self._read_arrays(step, target, meta["arrays"])
        if not allow_nonfinite:
            self._check_finite(step, restored)
        for obj, item in ((model, "model"), (optimizer, "optimizer")):
            if obj is not None:
                state = nnx.state(obj)
                nnx.replace_by_pure_dict(state, restored[item])
                nnx.update(obj, state)

    def _where(self, step: int) -> str:
        return f"step {step} in {self.directory}"

    def _read_meta(self, step: int) -> dict:
        try:
            with _quiet_orbax():
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            if not isinstance(meta, dict) or meta.get("format") != _FORMAT or "arrays" not in meta:
                raise ValueError(f"expected a dict of format {_FORMAT} with arrays")
        except Exception as error:  # whatever orbax raises on a missing or garbled file
            reason = f"its metadata cannot be read ({_first_line(error)}); written by an older version?"
            raise DamagedCheckpointError(self._where(step), reason) from None
        return meta

    def _check_settings(self, step: int, meta: dict, model, optimizer, config) -> None:
        """The model's description and the config against those recorded; the optimizer's presence."""
        described = self._description(model)
        if described is not None and meta.get("model") is not None and described != meta["model"]:
            raise CheckpointError(
                f"{self._where(step)} was saved from another model: "
                f"{_listed(_differences(meta['model'], described))}; restore into a model built as it was "
                f"saved (copy its parameters with nnx.update to try another)"
            )
        recorded = meta.get("encodings")  # absent from checkpoints saved before it was recorded
        encodings = self._encodings(model)
        if recorded is not None and recorded != encodings:
            raise CheckpointError(
                f"{self._where(step)} was saved from a model with other encodings or attention layers: "
                f"{_listed(_differences(recorded, encodings))}; restore into a model built with the encodings it "
                f"was saved with (copy its parameters with nnx.update to try another)"
            )
        if config is not None:
            wanted = _as_json(dict(config), "config")
            if wanted != meta.get("config"):
                raise CheckpointError(
                    f"{self._where(step)} was saved with another config: "
                    f"{_listed(_differences(meta.get('config') or {}, wanted))}; "
                    f"restore with the config it was saved with, or use another directory"
                )
        if optimizer is not None and "optimizer" not in meta["arrays"]:
            raise CheckpointError(
                f"{self._where(step)} holds no optimizer state (saved as save(step, model)); restore the model alone"
            )

    def _check_layout(self, step: int, item: str, recorded: dict, tree) -> None:
        """The paths, shapes and dtypes of ``tree`` against those recorded, naming a few differences."""
        saved = {name: (tuple(a["shape"]), a["dtype"]) for name, a in recorded.items()}
        here = _layout(tree)
        if saved == here:
            return
        show = lambda layout: "missing" if layout is None else f"{layout[0]} {layout[1]}"
        paths = sorted(saved.keys() | here.keys())
        differences = [
            f"{name}: {show(saved.get(name))} there, {show(here.get(name))} here"
            for name in paths
            if saved.get(name) != here.get(name)
        ]
        raise CheckpointError(
            f"{self._where(step)}: the {item}'s arrays differ from the saved ones at {len(differences)} of "
            f"{len(paths)} paths: {_listed(differences)}; build the {item} as it was when saved"
        )

    def _check_finite(self, step: int, restored: dict) -> None:
        """Refuses a step whose arrays hold NaN or inf (a diverged run), naming them and an earlier step."""
        for item, tree in restored.items():
            found, total = _nonfinite(tree)
            if not found:
                continue
            earlier = [s for s in self.all_steps() if s < step]
            instead = f"restore an earlier step (step={earlier[-1]})" if earlier else "no earlier step is kept here"
            raise CheckpointError(
                f"{self._where(step)} holds NaN or inf in {len(found)} of {total} {item} arrays: {_listed(found)}; "
                f"the run had diverged by then: {instead}, or pass allow_nonfinite=True to load it as it is"
            )

    def _read_arrays(self, step: int, target: dict, recorded: dict) -> dict:
        """The step's arrays for the items of ``target``, each checked against its recorded sha256."""
        if self.process_local:  # read into host arrays (see save), placed on this process's device below
            target = jax.device_get(target)
        args = {item: ocp.args.StandardRestore(tree) for item, tree in target.items()}
        try:
            with _quiet_orbax():
                restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        except Exception as error:  # unreadable array data
            raise DamagedCheckpointError(
                self._where(step), f"its arrays cannot be read ({_first_line(error)})"
            ) from None
        for item in target:
            read = _digests(restored[item])
            bad = [name for name, array in recorded[item].items() if read.get(name) != array["sha256"]]
            if bad:
                reason = f"{len(bad)} {item} array(s) differ from the sha256 saved with them: {_listed(bad)}"
                raise DamagedCheckpointError(self._where(step), reason)
        if self.process_local:
            restored = {item: jax.tree.map(jnp.asarray, restored[item]) for item in target}
        return restored


def _differences(saved: Mapping, here: Mapping) -> list[str]:
    """``key=<saved> there, <here> here`` for each key whose values differ."""
    unset = "<unset>"
    return [
        f"{key}={saved.get(key, unset)!r} there, {here.get(key, unset)!r} here"
        for key in sorted(saved.keys() | here.keys())
        if saved.get(key, unset) != here.get(key, unset)
    ]


def _check_step(step) -> None:
    check_count("step", step, 0, fix="a checkpoint's step is a training step count: 0, 1, 2, ...")
