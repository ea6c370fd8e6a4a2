# subagent-seam developer tasks. `make help` lists them.
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: help install interop test test-fast fuzz lint format demo bench schema trace-screenshot

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-17s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $@

install: $(STAMP) ## create .venv and install the package with its test and lint tools

# The official TypeScript ACP SDK's example agent, driven by the interop tests (1.9.0 is the last
# release that ships dist/examples). Skipped quietly where npm is missing; CI requires it.
INTEROP_AGENT := .interop/node_modules/@agentclientprotocol/sdk/dist/examples/agent.js
$(INTEROP_AGENT):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .interop @agentclientprotocol/sdk@1.9.0; \
	else echo "npm not found: the interop tests will be skipped"; fi

# Real agents, pinned, each in its own npm prefix (their dependencies pin other SDK versions), driven by
# tests/test_real_agents.py against a fake model server on loopback: no network, no keys. Every native
# binary they run comes from npm as a platform package (optionalDependencies), from no other host.
CLAUDE_ACP := .interop/claude-agent-acp/node_modules/@agentclientprotocol/claude-agent-acp/dist/index.js
$(CLAUDE_ACP):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .interop/claude-agent-acp \
			@agentclientprotocol/claude-agent-acp@0.101.0; \
	else echo "npm not found: the real-agent tests will be skipped"; fi

QWEN_CODE := .interop/qwen-code/node_modules/@qwen-code/qwen-code/cli.js
$(QWEN_CODE):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .interop/qwen-code @qwen-code/qwen-code@0.24.4; \
	else echo "npm not found: the real-agent tests will be skipped"; fi

CODEX_ACP := .interop/codex-acp/node_modules/@zed-industries/codex-acp/bin/codex-acp.js
$(CODEX_ACP):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .interop/codex-acp @zed-industries/codex-acp@0.16.0; \
	else echo "npm not found: the real-agent tests will be skipped"; fi

# The ACP project's own Codex adapter; it runs `codex app-server` from @openai/codex, pinned here too (the
# adapter asks for ^0.166.0).
CODEX_ACP_2 := .interop/codex-acp-2/node_modules/@agentclientprotocol/codex-acp/dist/index.js
$(CODEX_ACP_2):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .interop/codex-acp-2 \
			@agentclientprotocol/codex-acp@2.6.0 @openai/codex@0.166.0; \
	else echo "npm not found: the real-agent tests will be skipped"; fi

# GitHub Copilot CLI (`copilot --acp`). Its native binary unpacks about 235 MB of its own files on first
# run, into $$COPILOT_PKG_CACHE_HOME/pkg: done once here, into the prefix, which the tests point it at
# (else each test's private HOME would get a copy).
COPILOT := .interop/copilot/node_modules/@github/copilot/npm-loader.js
$(COPILOT):
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix .interop/copilot @github/copilot@1.0.102 && \
		COPILOT_PKG_CACHE_HOME=.interop/copilot/cache COPILOT_OFFLINE=1 COPILOT_AUTO_UPDATE=false \
			COPILOT_DISABLE_TELEMETRY=1 node $@ --version >/dev/null; \
	else echo "npm not found: the real-agent tests will be skipped"; fi

# Mistral Vibe (`vibe-acp`), from PyPI, in a virtual environment of its own: it needs Python 3.12 or newer,
# the first one found on PATH or among pyenv's versions (a pyenv shim of a version not selected fails the
# check and is passed over). Its bundled native binary comes in its wheel. Skipped quietly where no such
# Python is found or the install fails; CI requires it.
VIBE_ACP := .interop/vibe/bin/vibe-acp
$(VIBE_ACP):
	@python=""; \
	for candidate in python3.14 python3.13 python3.12 $$(pyenv root 2>/dev/null)/versions/3.1[2-9]*/bin/python3; do \
		if "$$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' >/dev/null 2>&1; then \
			python=$$candidate; break; \
		fi; \
	done; \
	if [ -z "$$python" ]; then echo "no Python 3.12 or newer: the mistral-vibe real-agent tests will be skipped"; \
	elif ! { "$$python" -m venv .interop/vibe && .interop/vibe/bin/python -m pip install --quiet mistral-vibe==3.0.2; }; then \
		rm -rf .interop/vibe; echo "mistral-vibe did not install: its real-agent tests will be skipped"; \
	fi

interop: $(INTEROP_AGENT) $(CLAUDE_ACP) $(QWEN_CODE) $(CODEX_ACP) $(CODEX_ACP_2) $(COPILOT) $(VIBE_ACP) ## install the third-party ACP agents the interop and real-agent tests drive

# The suite mostly waits (on child processes and timeouts), so it is spread over four workers a core (on 2
# cores, 8 workers used 1.4 cores on average); tests/conftest.py schedules them: one test at a time, the Ray
# tests as two units, each on a worker of its own.
TEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 2) * 4 )))
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE, as on CI): else every
# worker rewrites every test module's asserts again, and every child agent compiles the package again.
PYTEST_PARALLEL := -n $(TEST_WORKERS)
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest
# Written once before the workers start, not by all of them at once: on a fresh clone the eight workers
# collecting together each rewrote every test module (about 6.5 s of CPU each, against 1.7 s warm; one
# collection writes those, and the test helpers' bytecode), and the first child agents each compiled the
# package (compileall: the modules no test imports at collection too). A second or two with warm caches.
WARM_CACHES := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m compileall -q subagent >/dev/null && \
	$(PYTEST) --collect-only -q -p no:cacheprovider >/dev/null

test: $(STAMP) interop ## run the whole test suite (what CI runs), spread over worker processes
	@$(WARM_CACHES)
	$(PYTEST) $(PYTEST_PARALLEL)

# The edit loop's tier: the in-process and protocol core, over memory streams and loopback sockets. Left
# out: tests that start child processes (agents, the CLI, sshd, Ray, chromium), real agents, fuzzing.
test-fast: $(STAMP) ## the in-process and protocol core only, for the edit loop (about a minute)
	@$(WARM_CACHES)
	$(PYTEST) $(PYTEST_PARALLEL) -m "not subprocess and not real_agent and not fuzz"

fuzz: $(STAMP) ## the fuzz tests at length (HYPOTHESIS_PROFILE=fuzz: thousands of inputs per property)
	HYPOTHESIS_PROFILE=fuzz $(BIN)/python -m pytest -m fuzz

lint: $(STAMP) ## ruff (lint and format check) and mypy --strict
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: $(STAMP) ## apply ruff's formatting and safe fixes
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

demo: $(STAMP) ## a full turn against the bundled stub agent: no network, no keys
	$(BIN)/subagent demo

bench: $(STAMP) ## run every benchmark under bench/ (installs the bench-only extra first); about 13 minutes (two Ray clusters, an sshd)
	$(BIN)/python -m pip install --quiet -e '.[dev,bench]'
	@start=$$(date +%s); for script in bench/[!_]*.py; do echo "== $$script"; $(BIN)/python $$script || exit 1; done; \
		echo "== make bench: every script ran in $$(( $$(date +%s) - start )) s"

schema: $(STAMP) ## regenerate subagent/acp/schema.py and schema_unstable.py from schema/acp/v1/
	$(BIN)/python scripts/gen_schema.py

trace-screenshot: $(STAMP) ## regenerate docs/trace-page.png: the trace page of a three-level run, in headless chromium
	SUBAGENT_REQUIRE_CHROMIUM=1 SUBAGENT_TRACE_SCREENSHOT=docs/trace-page.png $(BIN)/python -m pytest -p no:cacheprovider \
		-q tests/test_trace_page.py -k "screenshot and asyncio"
