"""The parts of scripts/check-docs (docs_*) and scripts/gen-api (gen_api_*), one module per
thing each owns; the scripts themselves are thin mains that put scripts/ on sys.path."""
