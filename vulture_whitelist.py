"""Names vulture (``scripts/lint``) cannot see used: called by a framework or a protocol, set
on a library's object, or read by the tests only. Each is a real use; anything else it
reports is dead code to remove."""

# ruff: noqa: B018
# mypy: ignore-errors
from vulture.whitelist_utils import Whitelist

_ = Whitelist()

# Dataclass and pydantic fields: read through asdict(), model_dump() and the API server.
_.modelstageVersion
_.stageSeconds
_.pipelineParallelSize
_.schemaVersion
_.effect
_.toleration_seconds
_.operator
_.requests
_.staged_at
_.queue_position
_.enforceEager  # engine_key.EngineArgs, keyed through asdict()
_.compilationConfig
_.loadFormat

# The operator's offline planner, loaded by `modelstage plan` through its entry point
# (pyproject.toml's modelstage.planners).
_.deployment_report

# The plugin's loaders, found by register() in plugin/<row name>.py through the format row
# each names (plugin.loader_for).
_.ModelstageRunaiStreamerLoader
_.ModelstageRunaiStreamerShardedLoader
_.ModelstageSafetensorsLoader

# kopf's handlers, registered by the decorator call that assigns them.
_.deployment_event
_.statefulset_event
_.leaderworkerset_event

# Settings a library reads from the object we were handed (kopf, huggingface_hub, tokenizers,
# argparse).
_.disabled
_.server_timeout
_.reporting_component
_.reporting_instance
_.client_timeout
_.mandatory
_.lifetime
_.finalizer
_.progress_storage
_.diffbase_storage
_.HF_HUB_DOWNLOAD_TIMEOUT
_.HF_HUB_DISABLE_TELEMETRY
_.pre_tokenizer
_.description
_.usage

# Protocols: prometheus_client's custom collector, Python's io.RawIOBase.
_.collect
_.readable
_.writable
_.seekable
_.tell

# What the tests read to compare runs and plans.
_.TIMING_FIELDS
_.ignored_sources
_.itemsize  # TensorInfo's, checked against each dtype's size by the header fuzzer

# The node agent: NodeCache report fields it sets (read through model_dump() by the API
# server and the operator), and what its tests read of an eviction plan.
_.copied_at
_.warmed_at
_.copying
_.heartbeat
_.bytes_after
_.last_verified
_.free_bytes
_.service_account  # the copy Job's ServiceAccount, beside its namespace
# The copy server's http.server hooks and settings (called and read by the standard library).
_.daemon_threads
_.protocol_version
_.server_version
_.do_POST
_.do_PUT
_.do_GET
_.log_message
# Names the operator's side uses (the roll patch's supplementalGroups, the Warming phase).
_.CACHE_GID
_.WARMING
# Status fields the operator writes for people and dashboards to read.
_.misses  # status.nodeCache.nodes[].misses
