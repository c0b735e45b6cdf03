#!/usr/bin/env bash
# Renders the diagrams' Graphviz sources (*.dot) to the SVGs beside them, which the
# README shows. Needs Graphviz (apt-get install graphviz). tests/tests/docs.rs checks
# that each SVG holds every label of its source.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
for dot in *.dot; do
    command dot -Tsvg "$dot" -o "${dot%.dot}.svg"
done
