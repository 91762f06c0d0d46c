# The two commands a fresh machine needs: `make run` and `make test`.
.PHONY: run test lint

run:
	@./scripts/setup.sh
	@.venv/bin/lucedesk $(ARGS)

test:
	@./scripts/setup.sh --dev
	.venv/bin/ruff check src tests bench
	.venv/bin/python -m pytest $(PYTEST_ARGS)

lint:
	@./scripts/setup.sh --dev
	.venv/bin/ruff check src tests bench
	.venv/bin/ruff format --check src tests bench
