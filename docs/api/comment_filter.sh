#!/bin/sh
# Doxygen's INPUT_FILTER for the public headers: their plain // comments become documentation.
# A line of its own starting with "// " documents what follows (///); a "// " after code on
# the same line documents that member (///<).
exec sed -e 's|^\( *\)// |\1/// |' -e 's|^\( *\)//$|\1///|' \
  -e 's|^\([^/"]*[;,{)]\) *// |\1  ///< |' "$1"
