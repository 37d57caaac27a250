# The install steps of scripts/bootstrap.sh and scripts/test.sh (sourced, not run). A quiet install takes
# minutes; someone watching a silent terminal stops it, and a stopped apt-get leaves dpkg interrupted for
# the next one. So each step says what it starts, with its size where known, and keeps saying it runs.

# Seconds between "still ..." lines; LDLM_HEARTBEAT_S shortens it (the tests use a fraction of a second).
heartbeat_s="${LDLM_HEARTBEAT_S:-20}"
# dpkg's state directory; LDLM_DPKG_DIR points the interrupted-dpkg check at another (the tests' fake one).
dpkg_dir="${LDLM_DPKG_DIR:-/var/lib/dpkg}"
# The package the playground's browser test drives, and the test that skips without it.
chromium_test=tests/serve/api/routes/test_playground.py

# Run "$@" in the foreground (so Ctrl-C still reaches it), printing "still LABEL (N s)..." every
# $heartbeat_s seconds until it ends; returns its status.
with_heartbeat() {
  local label="$1" owner=$$ beat rc=0
  shift
  (
    start=$SECONDS
    # sleep's output goes nowhere, so a sleep outliving this loop holds no caller's pipe open
    while sleep "$heartbeat_s" </dev/null >/dev/null 2>&1; do
      kill -0 "$owner" 2>/dev/null || exit 0  # the script was stopped: say nothing more
      echo "  still $label ($((SECONDS - start)) s)..."
    done
  ) &
  beat=$!
  "$@" || rc=$?
  kill "$beat" 2>/dev/null || true
  wait "$beat" 2>/dev/null || true
  return "$rc"
}

# Run "$@" with its output appended to the file $1 instead of the terminal.
logged() {
  local log="$1"
  shift
  "$@" >>"$log" 2>&1
}

# pip install "$@" with .venv's python ($py), showing only the wheels it fetches (pip names a download
# with its size; a local wheel's size is read here) and how many packages it then unpacks; its errors
# still reach stderr. Returns pip's status.
pip_install_shown() {
  local line file
  PYTHONUNBUFFERED=1 "$py" -m pip install --progress-bar off "$@" | while IFS= read -r line; do
    line="${line#"${line%%[! ]*}"}"
    case "$line" in
      Downloading*) echo "  pip: $line" ;;
      "Processing "*.whl)
        file="${line#Processing }"
        echo "  pip: $line ($(($(stat -c %s "$file" 2>/dev/null || echo 0) / 1000000)) MB)"
        ;;
      "Installing collected packages:"*)
        line="${line#*: }"
        echo "  pip: unpacking $(($(tr -cd , <<<"$line" | wc -c) + 1)) packages into .venv (no output until done)"
        ;;
    esac
  done
  return "${PIPESTATUS[0]}"
}

# Prints why apt-get would refuse to install (a dpkg run left unfinished, as when an install is stopped
# midway) with its fix, and succeeds; fails, printing nothing, when dpkg is in order.
dpkg_interrupted() {
  local pending
  # dpkg journals each unfinished step as a file named by digits; it refuses to start while one is there
  pending=$(ls -A "$dpkg_dir/updates" 2>/dev/null | grep -c '^[0-9][0-9]*$') || return 1
  [ "$pending" -gt 0 ] || return 1
  echo "dpkg was left interrupted ($pending unfinished step(s) in $dpkg_dir/updates/, e.g. an apt-get install that was stopped): apt-get cannot install until it is finished; run 'dpkg --configure -a' as root, then run this again"
}

# What apt-get would download for chromium ("103 MB/115 MB": what it lacks of the total), or nothing
# where its package lists do not know chromium yet.
chromium_download_size() {
  apt-get install --print-uris -y --no-install-recommends chromium 2>/dev/null |
    sed -n 's/^Need to get \(.*\) of archives\.$/\1/p'
}

# apt-get install chromium, saying so first with its download size ($1, or empty where unknown), its
# output appended to the file $2.
apt_install_chromium() {
  echo "apt-get install chromium (${1:-size unknown} to download), for $chromium_test"
  with_heartbeat "installing chromium (apt-get install)" \
    logged "$2" apt-get install -y --no-install-recommends chromium
}

# Install chromium with apt-get (as root), refreshing apt's package lists first where they lack it and
# after an install that failed on stale ones. Never fails: without chromium the browser test skips, and
# this says why.
install_chromium() {
  local size log
  if dpkg_interrupted >&2; then
    echo "chromium not installed; $chromium_test will skip" >&2
    return 0
  fi
  log=$(mktemp)
  size=$(chromium_download_size)
  if { [ -n "$size" ] && apt_install_chromium "$size" "$log"; } || {
    echo "apt-get update: apt's package lists are missing or stale for chromium"
    with_heartbeat "updating apt's package lists (apt-get update)" logged "$log" apt-get update &&
      apt_install_chromium "$(chromium_download_size)" "$log"
  }; then
    rm -f "$log"
  else
    echo "chromium could not be installed (apt-get's output: $log); $chromium_test will skip" >&2
  fi
}
