"""The node cache's two processes: ``modelstage node-copy`` (a copy Job in a tenant's
namespace: streams one artifact from its claim or S3 to the agent on its node) and ``modelstage
agent`` (the DaemonSet: receives and verifies copies, reports what the root holds, warms,
evicts, re-verifies, labels its node).

Both import only the core and the API (``modelstage.api``: its Kubernetes client and the
``NodeCache`` models): never torch, the stager, the plugin, the operator or the dev tools.
Only the agent writes or deletes under the root, at paths built from checked contents
(``modelstage.core.node_cache``).
"""
