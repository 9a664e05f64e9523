# The README's commands. `make test` is what .ci/run calls.
PY := .venv/bin/python
# The checkout has a folder named `operator`; keep the working directory off sys.path.
export PYTHONSAFEPATH := 1

.PHONY: setup demo test lint
setup:
	./scripts/setup

demo: setup
	.venv/bin/modelstage demo

test: setup
	./scripts/test

lint: setup
	.venv/bin/ruff check stager operator tests
	.venv/bin/mypy -p modelstage.stager -p modelstage.operator
