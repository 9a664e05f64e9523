"""The node cache's two processes on a node: ``modelstage node-copy`` (a copy Job: one
artifact from the PVC or S3 into the node-local root, verified as it lands) and ``modelstage
agent`` (the DaemonSet: reports what the root holds, warms, evicts, labels its node).

Both run in the stager image but import only the core and the operator's Kubernetes client and
``NodeCache`` models: never torch, the stager, the plugin or the dev tools. Everything they
write or delete is under the one root, at paths built from checked digests
(``modelstage.core.node_cache``).
"""
