#!/usr/bin/env bash
# Best effort: the browser tests need Debian's Chromium. They skip with a message when it is missing.
set -u
if [ -x /usr/bin/chromium ]; then exit 0; fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-noto-cjk >/dev/null) \
    || echo "could not install chromium: browser tests will be skipped"
else
  echo "chromium missing and not root: browser tests will be skipped (apt-get install chromium)"
fi
