# The README's commands. `make test` is what .ci/run calls.
PY := .venv/bin/python

.PHONY: setup demo test test-slow lint
setup:
	./scripts/setup

demo: setup
	.venv/bin/modelstage demo

test: setup
	./scripts/test

# The long fault-injection trials (operator kills x10, S3 kill points x20) and the costlier vLLM
# oracle cases (TP 4, float16 at TP 2, a bfloat16 source cast to float32); .ci/run runs them too.
test-slow: setup
	MODELSTAGE_TEST_MARKERS=slow ./scripts/test

# ruff, mypy (strict), the import contracts (import-linter), dead code (vulture) and the
# 60-line limit on functions (scripts/function_length.py).
lint: setup
	./scripts/lint
