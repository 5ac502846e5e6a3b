//! How large an HTTP/1.1 client says its chunked request bodies are, read off the bytes of its
//! connection as they arrive.
//!
//! hyper streams a chunked body as its bytes come and never tells how large a chunk was
//! declared to be. A client that sends `40000000` (1 GiB) as its first chunk's size and then
//! a few bytes, or none, would hold a reader bounded by `max_body_bytes` until its deadline.
//! Here the connection's bytes are followed through the HTTP/1 framing — each request head,
//! then its `Content-Length` bytes or its chunks — and the sum of the chunk sizes declared so
//! far for the request being read is published as each chunk is declared, so that a reader
//! can refuse the body as soon as that sum is over its limit ([`DeclaredBody::over`]).
//!
//! The follower only ever *adds* a reason to refuse: anything it does not read exactly as hyper
//! does (HTTP/2, a bare LF, an upgrade, a repeated or unparsable framing header, a head larger
//! than [`MAX_HEAD`]) stops it for the rest of the connection, and from then on nothing is
//! published. hyper itself still decides what the request and its body are.

use tokio::sync::watch;

/// A request head larger than this is not followed (hyper refuses it anyway).
const MAX_HEAD: usize = 256 * 1024;

/// The request whose body is being framed (the first on a connection is 1), and the sum of
/// the chunk sizes its body has declared so far (0 for a body that is not chunked).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Declared {
    request: u64,
    bytes: u64,
}

/// Where the follower is in the connection's byte stream.
#[derive(Debug)]
enum State {
    /// Collecting a request head up to its empty line.
    Head(Vec<u8>),
    /// Skipping this many bytes of a `Content-Length` body.
    Fixed(u64),
    /// Reading a chunk size in hex.
    Size {
        size: u64,
        digits: usize,
    },
    /// The rest of a chunk-size line (whitespace, extensions) up to its LF.
    SizeLine {
        size: u64,
    },
    /// Skipping this many bytes of chunk data.
    Data(u64),
    /// The CR, then the LF, after a chunk's data.
    DataCr,
    DataLf,
    /// After the last chunk: trailer lines up to an empty one; the length of the current line.
    Trailers(usize),
    /// Not followed any more.
    Off,
}

/// Follows one connection's bytes; owned by its byte stream.
#[derive(Debug)]
pub(super) struct Framing {
    state: State,
    declared: Declared,
    publish: watch::Sender<Declared>,
}

/// What a request carries (as an extension) to learn what its body declared.
#[derive(Debug, Clone)]
pub struct DeclaredBody {
    request: u64,
    declared: watch::Receiver<Declared>,
}

impl DeclaredBody {
    /// Resolves as soon as this request's chunked body has declared chunks summing to more
    /// than `limit` bytes; never otherwise.
    pub async fn over(mut self, limit: u64) {
        loop {
            let now = *self.declared.borrow_and_update();
            if now.request == self.request && now.bytes > limit {
                return;
            }
            // Past this request (its body is framed whole and in hyper's buffer: a reader
            // bounded by the limit sees it), or the connection is gone: nothing more to learn.
            if now.request > self.request || self.declared.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

/// Numbers a connection's requests in the order hyper hands them to the service, to match
/// them with the heads [`Framing`] counted.
#[derive(Debug)]
pub(super) struct Requests {
    next: std::sync::atomic::AtomicU64,
    declared: watch::Receiver<Declared>,
}

impl Requests {
    /// The next request's [`DeclaredBody`]. HTTP/1 serves a connection's requests one after
    /// another, in order; over HTTP/2 the follower is off and nothing is ever declared.
    pub(super) fn next(&self) -> DeclaredBody {
        let request = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        DeclaredBody {
            request,
            declared: self.declared.clone(),
        }
    }
}

impl Framing {
    /// A follower for a new connection, and the numbering of its requests.
    pub(super) fn new() -> (Framing, Requests) {
        let (publish, declared) = watch::channel(Declared::default());
        let framing = Framing {
            state: State::Head(Vec::new()),
            declared: Declared::default(),
            publish,
        };
        let requests = Requests {
            next: std::sync::atomic::AtomicU64::new(0),
            declared,
        };
        (framing, requests)
    }

    /// Follows `bytes`, just read from the connection.
    pub(super) fn read(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let used = self.step(bytes);
            bytes = &bytes[used..];
        }
    }

    /// Takes what it can of `bytes` in the current state; returns how many it used (at least
    /// one).
    fn step(&mut self, bytes: &[u8]) -> usize {
        match &mut self.state {
            State::Off => bytes.len(),
            State::Head(head) => {
                // Empty lines before a request line are skipped, as hyper does.
                if head.is_empty() && matches!(bytes[0], b'\r' | b'\n') {
                    return 1;
                }
                let room = MAX_HEAD.saturating_sub(head.len());
                let take = match find_head_end(head, bytes) {
                    Some(end) => end,
                    None if bytes.len() > room => {
                        self.state = State::Off;
                        return bytes.len();
                    }
                    None => {
                        head.extend_from_slice(bytes);
                        return bytes.len();
                    }
                };
                if head.is_empty() {
                    // The whole head arrived in one read, as it almost always does: framed
                    // from the read's own bytes, nothing copied.
                    self.state = self.body_of(&bytes[..take]);
                    return take;
                }
                head.extend_from_slice(&bytes[..take]);
                let head = std::mem::take(head);
                self.state = self.body_of(&head);
                take
            }
            State::Fixed(left) => {
                let take = usize::try_from(*left).map_or(bytes.len(), |l| l.min(bytes.len()));
                *left -= take as u64;
                if *left == 0 {
                    self.state = State::Head(Vec::new());
                }
                take
            }
            State::Size { size, digits } => {
                let byte = bytes[0];
                match (byte as char).to_digit(16) {
                    Some(digit) => match size
                        .checked_mul(16)
                        .and_then(|s| s.checked_add(digit.into()))
                    {
                        Some(next) => {
                            *size = next;
                            *digits += 1;
                        }
                        None => self.state = State::Off,
                    },
                    None if *digits > 0 && matches!(byte, b'\r' | b';' | b' ' | b'\t') => {
                        let size = *size;
                        self.chunk_declared(size);
                        self.state = State::SizeLine { size };
                    }
                    None => self.state = State::Off,
                }
                1
            }
            State::SizeLine { size } => {
                if bytes[0] == b'\n' {
                    self.state = match *size {
                        0 => State::Trailers(0),
                        size => State::Data(size),
                    };
                }
                1
            }
            State::Data(left) => {
                let take = usize::try_from(*left).map_or(bytes.len(), |l| l.min(bytes.len()));
                *left -= take as u64;
                if *left == 0 {
                    self.state = State::DataCr;
                }
                take
            }
            State::DataCr => {
                self.state = if bytes[0] == b'\r' {
                    State::DataLf
                } else {
                    State::Off
                };
                1
            }
            State::DataLf => {
                self.state = if bytes[0] == b'\n' {
                    State::Size { size: 0, digits: 0 }
                } else {
                    State::Off
                };
                1
            }
            State::Trailers(line) => {
                match bytes[0] {
                    b'\n' if *line == 0 => self.state = State::Head(Vec::new()),
                    b'\n' => *line = 0,
                    b'\r' => {}
                    _ => *line += 1,
                }
                1
            }
        }
    }

    /// A chunk of `size` bytes was declared for the current request.
    fn chunk_declared(&mut self, size: u64) {
        self.declared.bytes = self.declared.bytes.saturating_add(size);
        if size > 0 {
            self.publish.send_replace(self.declared);
        }
    }

    /// What follows a complete request `head`: its body's framing, or `Off` for anything not
    /// read here exactly as hyper reads it.
    fn body_of(&mut self, head: &[u8]) -> State {
        let Some(framing) = body_framing(head) else {
            return State::Off;
        };
        // Published with its first chunk: until then it has declared nothing, which no
        // reader acts on (a reader of an earlier request waits as it would past its own).
        self.declared = Declared {
            request: self.declared.request + 1,
            bytes: 0,
        };
        match framing {
            Body::Chunked => State::Size { size: 0, digits: 0 },
            Body::Length(0) => State::Head(Vec::new()),
            Body::Length(n) => State::Fixed(n),
        }
    }
}

/// Where in `bytes` the head that `head` began ends (just past its empty line), if it does.
/// A bare LF ends a line for hyper; the head is then not followed (`body_framing` refuses it).
fn find_head_end(head: &[u8], bytes: &[u8]) -> Option<usize> {
    // The empty line may straddle the two: the last three bytes of `head` come first. Byte
    // `j` of that tail followed by `bytes`, without copying either.
    let tail = &head[head.len() - head.len().min(3)..];
    let at = |j: usize| {
        tail.get(j)
            .copied()
            .unwrap_or_else(|| bytes[j - tail.len()])
    };
    // Only a LF can end the empty line: the bytes between are skipped a word at a time.
    memchr::memchr_iter(b'\n', bytes).find_map(|i| {
        let end = tail.len() + i;
        ((end >= 1 && at(end - 1) == b'\n')
            || (end >= 2 && at(end - 1) == b'\r' && at(end - 2) == b'\n'))
            .then_some(i + 1)
    })
}

enum Body {
    Chunked,
    Length(u64),
}

/// The framing of the body after `head`, or `None` where this follower stops: not HTTP/1.x,
/// a line not ended by CRLF, `CONNECT` or `Upgrade` (what follows may not be HTTP), a
/// `Transfer-Encoding` other than one header ending in `chunked`, or `Content-Length`s that
/// are not one decimal number.
fn body_framing(head: &[u8]) -> Option<Body> {
    let text = std::str::from_utf8(head).ok()?;
    let text = text.strip_suffix("\r\n\r\n")?;
    let mut lines = text.split("\r\n");
    let request_line = lines.next()?;
    if request_line.contains('\n')
        || request_line.starts_with("CONNECT ")
        || !(request_line.ends_with(" HTTP/1.1") || request_line.ends_with(" HTTP/1.0"))
    {
        return None;
    }
    let mut chunked = None;
    let mut length: Option<u64> = None;
    for line in lines {
        if line.contains('\n') || line.starts_with([' ', '\t']) {
            return None;
        }
        let (name, value) = line.split_once(':')?;
        let value = value.trim_matches([' ', '\t']);
        if name.eq_ignore_ascii_case("transfer-encoding") {
            let last = value.rsplit(',').next()?.trim_matches([' ', '\t']);
            if chunked.is_some() || !last.eq_ignore_ascii_case("chunked") {
                return None;
            }
            chunked = Some(());
        } else if name.eq_ignore_ascii_case("content-length") {
            if !value.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            let n = value.parse().ok()?;
            if length.is_some_and(|l| l != n) {
                return None;
            }
            length = Some(n);
        } else if name.eq_ignore_ascii_case("upgrade") {
            return None;
        }
    }
    match (chunked, length) {
        (Some(()), _) => Some(Body::Chunked),
        (None, length) => Some(Body::Length(length.unwrap_or(0))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn declared(bytes: &[&[u8]]) -> (Declared, bool) {
        let (mut framing, _requests) = Framing::new();
        for piece in bytes {
            framing.read(piece);
        }
        (framing.declared, matches!(framing.state, State::Off))
    }

    #[test]
    fn chunk_sizes_are_summed_per_request_in_whatever_pieces_they_arrive() {
        let request = b"POST /p HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n\
                        4\r\nabcd\r\n10;ext=1\r\n0123456789abcdef\r\n0\r\nX-T: 1\r\n\r\n";
        let (whole, off) = declared(&[request]);
        assert_eq!(
            whole,
            Declared {
                request: 1,
                bytes: 20
            }
        );
        assert!(!off);
        let pieces: Vec<&[u8]> = request.chunks(1).collect();
        assert_eq!(declared(&pieces).0, whole);
        // A second request starts its own sum; a Content-Length body is skipped whole.
        let (two, _) = declared(&[
            request,
            b"POST /p HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
            b"POST /p HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n40000000\r\nab",
        ]);
        assert_eq!(
            two,
            Declared {
                request: 3,
                bytes: 0x4000_0000
            }
        );
    }

    #[test]
    fn anything_not_read_as_hyper_reads_it_stops_the_follower() {
        for head in [
            &b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"[..],
            b"POST /p HTTP/1.1\nTransfer-Encoding: chunked\n\n",
            b"GET / HTTP/1.1\r\nUpgrade: websocket\r\n\r\n",
            b"CONNECT h:443 HTTP/1.1\r\nHost: h:443\r\n\r\n",
            b"POST /p HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            b"POST /p HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n",
            b"POST /p HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        ] {
            let (_, off) = declared(&[head]);
            assert!(off, "{}", String::from_utf8_lossy(head));
        }
    }

    #[tokio::test]
    async fn a_request_learns_only_its_own_bodys_declared_size() {
        let (mut framing, requests) = Framing::new();
        let (first, second) = (requests.next(), requests.next());
        framing.read(b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nab");
        framing.read(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n401\r\n");
        let over = |body: DeclaredBody, limit| async move {
            tokio::time::timeout(std::time::Duration::from_millis(50), body.over(limit))
                .await
                .is_ok()
        };
        assert!(over(second.clone(), 1024).await);
        assert!(!over(second, 1025).await);
        assert!(!over(first, 0).await, "the first request declared no chunk");
    }

    /// The head's end as found by copying the last three bytes of `head` and each new byte
    /// into a window: the obvious form `find_head_end` must agree with.
    fn find_head_end_by_window(head: &[u8], bytes: &[u8]) -> Option<usize> {
        let keep = head.len().min(3);
        let mut window = head[head.len() - keep..].to_vec();
        for (i, &byte) in bytes.iter().enumerate() {
            window.push(byte);
            if window.ends_with(b"\n\r\n") || window.ends_with(b"\n\n") {
                return Some(i + 1);
            }
        }
        None
    }

    mod head_end {
        use super::*;
        use proptest::prelude::*;

        /// Bytes over a small alphabet, so that line ends, near misses and empty lines are
        /// common.
        fn text() -> impl Strategy<Value = Vec<u8>> {
            proptest::collection::vec(
                prop_oneof![
                    Just(b'\r'),
                    Just(b'\n'),
                    Just(b'a'),
                    Just(b':'),
                    any::<u8>()
                ],
                0..24,
            )
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(4096))]

            #[test]
            fn agrees_with_a_window_over_any_split(whole in text(), at in any::<prop::sample::Index>()) {
                let at = if whole.is_empty() { 0 } else { at.index(whole.len() + 1) };
                let (head, bytes) = whole.split_at(at);
                prop_assert_eq!(find_head_end(head, bytes), find_head_end_by_window(head, bytes));
            }
        }

        #[test]
        fn heads_ending_at_or_straddling_a_chunk_boundary() {
            for whole in [
                &b"GET / HTTP/1.1\r\nHost: h\r\n\r\n"[..],
                b"GET / HTTP/1.1\nHost: h\n\n",
                b"GET / HTTP/1.1\r\n\r\nnext",
                b"\n\n",
                b"\n\r\n",
                b"\r\n\r\n",
                b"a\r\r\n\r\n",
            ] {
                for at in 0..=whole.len() {
                    let (head, bytes) = whole.split_at(at);
                    assert_eq!(
                        find_head_end(head, bytes),
                        find_head_end_by_window(head, bytes),
                        "{:?} split at {at}",
                        String::from_utf8_lossy(whole)
                    );
                }
            }
            assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n\r", b"\n"), Some(1));
            assert_eq!(find_head_end(b"GET / HTTP/1.1\n", b"\nrest"), Some(1));
            assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n\r\n", b""), None);
        }
    }
}
