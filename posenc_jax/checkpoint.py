"""Saving and restoring models and optimizers with orbax-checkpoint.

:class:`Checkpointer` keeps the last N checkpoints of an NNX model and its
optimizer (parameters, optimizer moments and step, RNG streams), so a restored
model gives identical outputs and training resumed from a checkpoint continues
exactly as it would have.
"""

from __future__ import annotations

import pathlib

import orbax.checkpoint as ocp
from flax import nnx

__all__ = ["Checkpointer"]


class Checkpointer:
    """An orbax ``CheckpointManager`` for ``(model, optimizer)`` pairs, keeping the last ``max_to_keep``.

    Example:
      >>> import tempfile, optax
      >>> from posenc_jax.nn import Transformer
      >>> model = Transformer(vocab_size=8, model_dim=16, num_layers=1, num_heads=2, mlp_dim=32,
      ...                     encoding="rope", rngs=nnx.Rngs(0))
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> ckpt = Checkpointer(tempfile.mkdtemp(), max_to_keep=2)
      >>> ckpt.save(10, model, optimizer)
      >>> ckpt.latest_step()
      10
    """

    def __init__(self, directory, *, max_to_keep: int = 3):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = pathlib.Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        )

    @staticmethod
    def _state(model, optimizer) -> dict:
        state = {"model": nnx.to_pure_dict(nnx.state(model))}
        if optimizer is not None:
            state["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
        return state

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer | None = None) -> None:
        """Saves the model (and optimizer) at ``step`` and waits until it is on disk."""
        self.manager.save(step, args=ocp.args.StandardSave(self._state(model, optimizer)))
        self.manager.wait_until_finished()

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer | None = None, step: int | None = None) -> int:
        """Loads the checkpoint at ``step`` (default: latest) into ``model`` and ``optimizer`` in place."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"no checkpoint in {self.directory}")
        target = self._state(model, optimizer)
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        for obj, key in ((model, "model"), (optimizer, "optimizer")):
            if obj is None:
                continue
            state = nnx.state(obj)
            nnx.replace_by_pure_dict(state, restored[key])
            nnx.update(obj, state)
        return step

    def close(self) -> None:
        self.manager.close()
