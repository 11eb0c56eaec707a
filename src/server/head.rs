//! The first request head of every connection is read and checked here before hyper serves the
//! connection. A head hyper would refuse with a bare status line and no body (a garbage request
//! line or header, an unreadable Content-Length, a head over 64 KiB or with more than 100
//! headers) gets the OpenAI error object that every other error carries, then the connection
//! closes. A good head (and whatever body bytes came with it) is replayed to hyper unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

/// Longest request head accepted (hyper's own limit is higher; OpenAI requests need a few hundred bytes).
const MAX_HEAD: usize = 64 << 10;
const MAX_HEADERS: usize = 100;

/// Why a head was refused: status and message.
pub struct Refusal {
    pub status: u16,
    pub message: String,
}

/// What the first bytes of a connection hold.
pub enum First {
    /// A complete, well-formed head: these bytes go to hyper first.
    Head(Vec<u8>),
    Refused(Refusal),
    /// The client went away or was too slow: close without an answer.
    Gone,
}

fn check(buf: &[u8]) -> Option<Result<(), Refusal>> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Partial) => None,
        Err(httparse::Error::TooManyHeaders) => {
            Some(Err(Refusal { status: 431, message: format!("the request has more than {MAX_HEADERS} headers") }))
        }
        Err(e) => Some(Err(Refusal { status: 400, message: format!("malformed HTTP request head: {e}") })),
        Ok(httparse::Status::Complete(_)) => {
            let mut len: Option<&[u8]> = None;
            for h in req.headers.iter().filter(|h| h.name.eq_ignore_ascii_case("content-length")) {
                let v = std::str::from_utf8(h.value).unwrap_or("").trim();
                if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) || v.len() > 19 {
                    return Some(Err(Refusal {
                        status: 400,
                        message: format!("invalid Content-Length {:?}", String::from_utf8_lossy(h.value)),
                    }));
                }
                if len.is_some_and(|l| l != v.as_bytes()) {
                    return Some(Err(Refusal { status: 400, message: "conflicting Content-Length headers".into() }));
                }
                len = Some(h.value);
            }
            Some(Ok(()))
        }
    }
}

/// Reads until the first head is complete (or refused), within `timeout`.
pub async fn read_first(stream: &mut TcpStream, timeout: Duration) -> First {
    let read = async {
        let mut buf = Vec::with_capacity(1024);
        let mut chunk = [0u8; 4096];
        loop {
            let n = match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return First::Gone,
                Ok(n) => n,
            };
            buf.extend_from_slice(&chunk[..n]);
            match check(&buf) {
                Some(Ok(())) => return First::Head(buf),
                Some(Err(r)) => return First::Refused(r),
                None if buf.len() > MAX_HEAD => {
                    return First::Refused(Refusal {
                        status: 431,
                        message: format!("the request head is larger than {} KiB", MAX_HEAD >> 10),
                    })
                }
                None => {}
            }
        }
    };
    tokio::time::timeout(timeout, read).await.unwrap_or(First::Gone)
}

/// Writes the refusal as an OpenAI error object and closes the connection.
pub async fn refuse(mut stream: TcpStream, r: &Refusal) {
    let reason = match r.status {
        431 => "Request Header Fields Too Large",
        _ => "Bad Request",
    };
    let e = super::openai::ApiError::new(r.status, "invalid_request_error", None, r.message.clone());
    let body = e.body().to_string();
    let head = format!(
        "HTTP/1.1 {} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        r.status,
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// A connection whose first bytes were already read: they are served again, then the socket.
pub struct Replay {
    prefix: Vec<u8>,
    at: usize,
    inner: TcpStream,
}

impl Replay {
    pub fn new(prefix: Vec<u8>, inner: TcpStream) -> Replay {
        Replay { prefix, at: 0, inner }
    }
}

impl AsyncRead for Replay {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.at < me.prefix.len() {
            let n = (me.prefix.len() - me.at).min(buf.remaining());
            buf.put_slice(&me.prefix[me.at..me.at + n]);
            me.at += n;
            if me.at == me.prefix.len() {
                me.prefix = Vec::new();
                me.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut me.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Replay {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::check;

    #[test]
    fn heads_are_checked() {
        assert!(check(b"GET / HTTP/1.1\r\nHost: x\r\n").is_none(), "partial");
        assert!(matches!(check(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), Some(Ok(()))));
        assert!(matches!(check(b"POST / HTTP/1.1\r\nContent-Length: 5\r\ncontent-length: 5\r\n\r\n"), Some(Ok(()))));
        for (bad, status) in [
            (&b"\x00\x01garbage\r\n\r\n"[..], 400),
            (b"GET / HTTP/1.1\r\nContent-Length: abc\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400),
        ] {
            match check(bad) {
                Some(Err(r)) => assert_eq!(r.status, status, "{:?}", String::from_utf8_lossy(bad)),
                _ => panic!("{:?} should be refused", String::from_utf8_lossy(bad)),
            }
        }
        let many: String = (0..150).map(|i| format!("X-{i}: y\r\n")).collect();
        match check(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes()) {
            Some(Err(r)) => assert_eq!(r.status, 431),
            _ => panic!("too many headers should be refused"),
        }
    }
}
