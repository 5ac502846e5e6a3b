#!/usr/bin/env bash
# Allocations per fenced request, by call site: railguard built with the C library's malloc
# (`--features system-allocator`) serves the wire suite's fenced phases, without and then with
# keys, under valgrind's DHAT, which records every allocation with its call stack. Run as
# `scripts/profile.sh --allocations`; writes /var/tmp/railguard-allocations/ and prints:
#
#   - allocations and bytes per answered request, all call sites together;
#   - the sites that allocate most often, by the innermost railguard function on their stack
#     (what railguard's code asked for, hyper's and tokio's allocations under it included);
#   - the blocks of 1 KiB and more, by where they are made: blocks above the allocator's small
#     size classes cost most to allocate and free.
#
# A request under DHAT is some fifty times slower, and the counts are what matters, not the
# rates: the run is short (3 s per phase, one repetition). Needs valgrind, python3 and what
# scripts/bench.sh needs.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=/var/tmp/railguard-allocations
rm -rf "$dir" && mkdir -p "$dir"
command -v valgrind >/dev/null || { echo "error: valgrind not found (apt-get install valgrind)" >&2; exit 1; }
target="${ALLOCATIONS_TARGET_DIR:-/var/tmp/railguard-allocations-target}"
echo "==> building railguard with the system allocator into $target" >&2
CARGO_TARGET_DIR="$target" cargo build --release --quiet --locked -p railguard --bin railguard \
    --features system-allocator

# The measured process is the suite's baseline route: it serves the fenced phases only. Its
# wrapper starts it under DHAT in a session of its own, so that the suite's SIGKILL at the end
# of the run reaches the wrapper and not the process: stopped with SIGTERM below, it exits
# and DHAT writes its file.
cat > "$dir/serve-under-dhat" <<WRAPPER
#!/usr/bin/env bash
if [ "\$1" = serve ]; then
    config="\$3"
    admin=\$(awk '/^\\[admin\\]/ { a = 1; next } /^\\[/ { a = 0 } a && /^listen *=/ { gsub(/[" ]/, ""); sub(/^listen=/, ""); print }' "\$config")
    ( setsid valgrind --tool=dhat --dhat-out-file="$dir/dhat.%p.json" "$target/release/railguard" "\$@" \\
        </dev/null >"$dir/serve.log" 2>&1 & echo "\$! \$admin" >> "$dir/processes" )
    exec sleep infinity
fi
exec "$target/release/railguard" "\$@"
WRAPPER
chmod +x "$dir/serve-under-dhat"

scripts/bench.sh --suite wire --duration-secs 3 --repeats 1 --latency-secs 0 \
    --baseline-bin "$dir/serve-under-dhat" --baseline-label "under DHAT" > "$dir/wire.md"

read -r pid admin < "$dir/processes"
requests=$(curl -fsS "http://$admin/metrics" |
    awk '/^railguard_requests_total/ { n += $NF } END { print n + 0 }')
kill -TERM "$pid"
for _ in $(seq 1 120); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
done
echo "requests answered by the measured process: $requests"
python3 - "$dir"/dhat.*.json "$requests" <<'SUMMARY'
import collections, json, re, sys

data = json.load(open(sys.argv[1]))
requests = max(float(sys.argv[2]), 1.0)
frames = data["ftbl"]

def name(i):
    match = re.search(r": (.*?) \(", frames[i])
    return (match.group(1) if match else frames[i])[:150]

blocks = collections.Counter()
size = collections.Counter()
large = collections.Counter()
total_blocks = total_bytes = 0
for site in data["pps"]:
    stack = [name(i) for i in site["fs"]]
    ours = next((f for f in stack if "railguard::" in f), "(no railguard frame)")
    blocks[ours] += site["tbk"]
    size[ours] += site["tb"]
    total_blocks += site["tbk"]
    total_bytes += site["tb"]
    if site["tbk"] and site["tb"] / site["tbk"] >= 1024:
        made = next((f for f in stack if re.match(r"(new|pin)<|.*reserve|.*Cell<", f)), ours)
        large[(made[:110], ours[:110])] += site["tbk"]

print(f"all sites: {total_blocks / requests:.1f} allocations and {total_bytes / requests:,.0f} bytes per request")
print("\nmost allocations per request, by the innermost railguard function on the stack:")
for where, n in blocks.most_common(30):
    print(f"  {n / requests:7.2f}  {size[where] / max(n, 1):8.0f} B on average  {where}")
print("\nblocks of 1 KiB and more per request, by what made them:")
for (made, ours), n in large.most_common(15):
    print(f"  {n / requests:7.2f}  {made}  (under {ours})")
SUMMARY
