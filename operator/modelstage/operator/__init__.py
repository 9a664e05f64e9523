"""The modelstage operator: ModelDeployment -> stager Job -> workload rollout (torch-free)."""
