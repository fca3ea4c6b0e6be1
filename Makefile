# The two commands a newcomer types (README): `make demo` and `make test`.
# Each creates or refreshes the virtual environment first, so nothing else needs installing.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test bench lint clean

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# Reinstall whenever the project metadata changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[test,demo]'
	touch $@

# Debian packages that integration tests run against (tests/integration/test_slurm.py starts a
# single-host Slurm): installed where the user is root and has apt.  Elsewhere, or if the
# install fails, those tests skip and say why; nothing else depends on them.
SYSTEM_PACKAGES := slurmctld slurmd slurm-client
$(VENV)/.system-packages: | $(BIN)/activate
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			--no-install-recommends $(SYSTEM_PACKAGES); } \
		|| echo "not installed: $(SYSTEM_PACKAGES); the tests that need them skip" >&2; \
	fi
	touch $@

demo: $(VENV)/.installed
	$(BIN)/fabricctl demo

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy examples  # scripts, not a package: checked on their own

test: lint $(VENV)/.system-packages
	$(BIN)/pytest

bench: $(VENV)/.installed
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) build *.egg-info
