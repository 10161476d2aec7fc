"""Calls sent again after their owner died: the `Rerun` the task service is built with."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.calls.call import Call
from proxy.calls.upstream_tasks import UpstreamTaskCall
from proxy.config import Config
from proxy.tasks.model import TaskRecord
from proxy.tasks.types import TaskSink
from proxy.upstream.types import Pool


class Rerunner:
    """Starts again, after its owner died, the upstream call of a task configured `on_restart: rerun`
    (`tasks.types.Rerun`): the record's `rerun` names the method, params and capabilities; `pools`
    are the upstream pools by server name. A task backed by the upstream's own task follows it again
    (`tasks/result`), so a cancel still reaches the upstream."""

    def __init__(self, config: Config, pools: Mapping[str, Pool]) -> None:
        self.config = config
        self.pools = pools

    def __call__(self, record: TaskRecord, sink: TaskSink) -> Call | None:
        """The started call of `record`, reporting to `sink`; None when its server is gone from the config."""
        pool = self.pools.get(record.server)
        if pool is None or record.rerun is None:
            return None
        policy = self.config.policy(record.server, record.tool)
        kind = UpstreamTaskCall if record.rerun["method"] == "tasks/result" else Call
        call = kind(
            pool=pool,
            server=record.server,
            tool=record.tool,
            method=record.rerun["method"],
            params=record.rerun["params"],
            capabilities=record.rerun["capabilities"],
            timeout=policy.timeout,
            input_timeout=policy.input_timeout,
            principal=record.principal,
        )
        call.detach(record.task_id, sink, progress_interval_s=policy.progress_interval)
        call.start()
        return call

    async def cancel_orphan(self, record: TaskRecord, reason: str) -> bool:
        """`tasks.types.CancelOrphan`: the cancel of `record`'s upstream request (`upstream_ref`),
        sent on the dead owner's upstream session through the server's pool; False when there is
        nothing to send it on (no ref, a stdio server, its server gone from the config)."""
        pool = self.pools.get(record.server)
        if pool is None or not record.upstream_ref:
            return False
        return await pool.cancel_elsewhere(
            record.upstream_ref, f"its task was taken over from the proxy process that sent it: {reason}"
        )
