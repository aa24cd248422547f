#!/usr/bin/env bash
# Best effort: the browser tests need Debian's Chromium (and a CJK font for the Chinese-rendering test).
# They skip with a message when Chromium cannot be launched.
set -u
missing=()
[ -x /usr/bin/chromium ] || missing+=(chromium)
dpkg -s fonts-noto-cjk >/dev/null 2>&1 || missing+=(fonts-noto-cjk)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
    || echo "could not install ${missing[*]}: browser tests may be skipped"
else
  echo "missing ${missing[*]} and not root: browser tests may be skipped (apt-get install ${missing[*]})"
fi
