"""The modelstage API: the ModelDeployment and NodeCache models (the CRDs are generated from
them), the thin Kubernetes client and the object helpers every Kubernetes-facing part shares
(owner references, labels). The operator, the stager and the node agent depend on it; it
depends on the core only."""
