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

demo: $(VENV)/.installed
	$(BIN)/fabricctl demo

lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy examples  # scripts, not a package: checked on their own

test: lint
	$(BIN)/pytest

bench: $(VENV)/.installed
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) build *.egg-info
