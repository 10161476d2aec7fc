"""`mcp-tasks-proxy tasks [--store DIR | --config FILE] list|show ID|cancel ID`: inspect or cancel
the tasks of a store (a diskcache directory, or the Redis store of a config), beside a running proxy."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from proxy.config import ConfigError, StoreConfig, load_config
from proxy.tasks.model import Change, TaskStatus, TerminalTaskError, iso
from proxy.tasks.open_store import open_store
from proxy.tasks.store import ListFilter, StoreUnavailableError, TaskNotFoundError
from proxy.tasks.wire_v2 import detailed_task


def run(argv: list[str]) -> int:
    """List, show or cancel tasks as `argv` says; the exit status (2: bad arguments or no store).
    An operator's cancel reaches the running proxy at its next sweep."""
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy tasks", description="Inspect or cancel tasks in a store directory."
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", help="the store directory (store.path)")
    where.add_argument("--config", help="a config file; its store (store.path or store.url) is used")
    sub = parser.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", help="one line per task, newest first")
    listing.add_argument("--status", choices=[s.value for s in TaskStatus])
    listing.add_argument("--limit", type=int, default=100)
    sub.add_parser("show", help="one task as JSON").add_argument("task_id")
    sub.add_parser("cancel", help="mark a task cancelled (sticky)").add_argument("task_id")
    # Task ids are base64url and may start with "-": never let argparse read them as options.
    for i, word in enumerate(argv[:-1]):
        if (
            word in ("show", "cancel")
            and argv[i + 1].startswith("-")
            and argv[i + 1] not in ("-h", "--help", "--")
        ):
            argv = [*argv[: i + 1], "--", *argv[i + 1 :]]
            break
    args = parser.parse_args(argv)
    try:
        store_cfg = StoreConfig(path=args.store) if args.store else load_config(args.config).store
    except ConfigError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 2
    if not store_cfg.redis and not os.path.isdir(store_cfg.path):
        print(f"mcp-tasks-proxy: no store at {store_cfg.path}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_action(args, store_cfg))
    except StoreUnavailableError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 1


async def _action(args: argparse.Namespace, store_cfg: StoreConfig) -> int:
    """The `tasks` subcommand's work on an open (shared, unlocked) store; returns the exit status."""
    try:
        store = open_store(
            store_cfg.model_copy(update={"durable": True}), max_result_bytes=16 * 1024 * 1024, exclusive=False
        )
    except StoreUnavailableError as exc:
        print(f"mcp-tasks-proxy: {exc}", file=sys.stderr)
        return 1
    try:
        if args.action == "list":
            records, more = await store.list_tasks(ListFilter(status=args.status), limit=args.limit)
            print(f"{'TASK ID':44} {'STATUS':15} {'SERVER':12} {'TOOL':24} CREATED")
            for r in records:
                print(
                    f"{r.task_id:44} {r.status.value:15} {r.server[:12]:12} {r.tool[:24]:24} "
                    f"{iso(r.created_ms)}"
                )
            print(
                f"{len(records)} task(s)"
                + (f" shown; more exist beyond --limit {args.limit}" if more else "")
            )
            return 0
        record = await store.get(args.task_id)
        if record is None:
            print(f"mcp-tasks-proxy: unknown or expired task {args.task_id}", file=sys.stderr)
            return 1
        if args.action == "show":
            out = {
                "server": record.server,
                "tool": record.tool,
                "principal": record.principal,
                "owner": record.owner,
                **detailed_task(record),
            }
            out.pop("resultType", None)
            print(json.dumps(out, indent=2))
            return 0
        if record.status.terminal:
            print(f"task {record.task_id} is already {record.status.value}")
            return 0
        try:
            await store.update(
                record.task_id,
                Change(
                    status=TaskStatus.CANCELLED, status_message="cancelled by an operator", input_requests={}
                ),
            )
        except (TerminalTaskError, TaskNotFoundError):
            print(f"task {record.task_id} ended meanwhile")
            return 0
        print(
            f"task {record.task_id} cancelled (a running proxy stops the upstream call at its next progress "
            f"update "
            "or sweep, within half of store.lease, and discards any later result)"
        )
        return 0
    finally:
        await store.close()
