//! The servers a `database.url` names, tried in turn, a slow one still heard while the next
//! is tried.
//!
//! A URL that names several servers (`postgres://u@pg1,pg2,pg3/db?target_session_attrs=read-write`)
//! is how a client follows a failover: whichever server takes writes now is the one it keeps.
//! tokio-postgres tries them in turn, and bounds each TCP connect by the connect timeout, but
//! not the start-up after it (TLS, the startup message, authentication, the read-write check).
//! A primary that failed without going away is the server a failover leaves behind: a paused
//! process (SIGSTOP, a stalled storage layer), whose kernel still accepts connections that
//! nothing answers, holds every connection for ever, or for as long as the caller's own
//! limit; a frozen machine (a VM stopped by its host), which leaves the TCP handshake
//! unanswered, uses up the whole connect timeout, which is also the pools' limit for a new
//! session. Either way the server that took over is never tried.
//!
//! So railguard splits the URL into one configuration per server and starts them in turn: the
//! next server as soon as one fails, or once the one before has had an equal share of the
//! connect timeout (`database.timeout_ms`) without answering — the attempts already started
//! go on, and the first server to connect wins. A server that answers slowly (a distant one,
//! TLS and authentication over a long round trip) is heard up to the whole timeout; one that
//! does not answer holds the next for its share only; and the connection is opened, or given
//! up on, within the timeout. A pool asking for a server that takes writes starts with the
//! one that answered its last new connection, so that after a change of server only its first
//! new connection waits for the one that went silent.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;
use tokio_postgres::config::{Host, LoadBalanceHosts, TargetSessionAttrs};
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Config, Connection, Socket};

/// How long one connection may take to open and answer its start-up, whichever servers it
/// tries: the configuration's connect timeout (`database.timeout_ms`, which `db::pg_config`
/// sets), 10 s where none is set.
pub(crate) fn connect_limit(config: &Config) -> Duration {
    config
        .get_connect_timeout()
        .copied()
        .unwrap_or(Duration::from_secs(10))
}

/// Each server's share of [`connect_limit`].
fn share(config: &Config) -> Duration {
    connect_limit(config) / servers(config)
}

/// How many servers `config` names (at least one).
fn servers(config: &Config) -> u32 {
    let named = config.get_hosts().len().max(config.get_hostaddrs().len());
    u32::try_from(named.max(1)).unwrap_or(u32::MAX)
}

/// One configuration per server `config` names, in the order tokio-postgres would try them
/// (shuffled with `load_balance_hosts=random`), each with everything else of `config`. A
/// configuration naming one server, or one whose lists do not match (which tokio-postgres
/// reports when it connects), comes back as it is.
pub(crate) fn one_per_server(config: &Config) -> Vec<Config> {
    let hosts = config.get_hosts();
    let addrs = config.get_hostaddrs();
    let ports = config.get_ports();
    let named = hosts.len().max(addrs.len());
    let mismatched = (!hosts.is_empty() && !addrs.is_empty() && hosts.len() != addrs.len())
        || (ports.len() > 1 && ports.len() != named);
    if named <= 1 || mismatched {
        return vec![config.clone()];
    }
    let mut each: Vec<Config> = (0..named)
        .map(|i| {
            let mut one = without_servers(config);
            match hosts.get(i) {
                Some(Host::Tcp(name)) => {
                    one.host(name);
                }
                Some(Host::Unix(path)) => {
                    one.host_path(path);
                }
                None => {}
            }
            if let Some(addr) = addrs.get(i) {
                one.hostaddr(*addr);
            }
            if let Some(port) = ports.get(i).or(ports.first()) {
                one.port(*port);
            }
            one
        })
        .collect();
    if config.get_load_balance_hosts() == LoadBalanceHosts::Random {
        shuffle(&mut each);
    }
    each
}

/// Everything of `config` but its hosts, addresses and ports.
fn without_servers(config: &Config) -> Config {
    let mut one = Config::new();
    if let Some(user) = config.get_user() {
        one.user(user);
    }
    if let Some(password) = config.get_password() {
        one.password(password);
    }
    if let Some(dbname) = config.get_dbname() {
        one.dbname(dbname);
    }
    if let Some(options) = config.get_options() {
        one.options(options);
    }
    if let Some(name) = config.get_application_name() {
        one.application_name(name);
    }
    if let Some(timeout) = config.get_connect_timeout() {
        one.connect_timeout(*timeout);
    }
    if let Some(timeout) = config.get_tcp_user_timeout() {
        one.tcp_user_timeout(*timeout);
    }
    one.ssl_mode(config.get_ssl_mode())
        .ssl_negotiation(config.get_ssl_negotiation())
        .keepalives(config.get_keepalives())
        .keepalives_idle(config.get_keepalives_idle())
        .target_session_attrs(config.get_target_session_attrs())
        .channel_binding(config.get_channel_binding())
        .load_balance_hosts(config.get_load_balance_hosts());
    if let Some(interval) = config.get_keepalives_interval() {
        one.keepalives_interval(interval);
    }
    if let Some(retries) = config.get_keepalives_retries() {
        one.keepalives_retries(retries);
    }
    one
}

fn shuffle(configs: &mut [Config]) {
    for i in (1..configs.len()).rev() {
        let draw = getrandom::u64().unwrap_or(0);
        let j = usize::try_from(draw % (i as u64 + 1)).unwrap_or(0);
        configs.swap(i, j);
    }
}

/// The server one configuration of [`one_per_server`] names, for messages: `host:port`.
pub(crate) fn name(config: &Config) -> String {
    let host = match (config.get_hosts().first(), config.get_hostaddrs().first()) {
        (Some(Host::Tcp(name)), _) => name.clone(),
        (Some(Host::Unix(path)), _) => path.display().to_string(),
        (None, Some(addr)) => addr.to_string(),
        (None, None) => "?".to_string(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!("{host}:{port}")
}

/// Why one server did not connect.
#[derive(Debug)]
pub(crate) enum Failure {
    Refused(tokio_postgres::Error),
    /// It had this long and did not connect.
    Unanswered(Duration),
}

/// Which of a URL's servers answered a pool's last new connection: the next one starts with it.
#[derive(Clone, Default)]
pub(crate) struct LastAnswered(Arc<AtomicUsize>);

/// The first of `config`'s servers to connect (and its place in [`one_per_server`]'s order),
/// starting from `first` (wrapping): the next server starts as soon as every one started has
/// failed, or once the last one started has had its share of [`connect_limit`]; those started
/// go on. `total`: when to give up on all of them (`None`: never, the caller bounds it).
/// `failed` hears each server that did not connect, those still starting when another
/// connected too; `None` when none did.
async fn first_to_connect<T>(
    config: &Config,
    tls: &T,
    first: usize,
    total: Option<Duration>,
    failed: &mut impl FnMut(&Config, Failure),
) -> Option<(usize, Client, Connection<Socket, T::Stream>)>
where
    T: MakeTlsConnect<Socket> + Clone,
{
    let share = share(config);
    let configs = one_per_server(config);
    let count = configs.len();
    let mut order = (0..count).map(|k| (first + k) % count);
    let began = Instant::now();
    let deadline = total.map(|total| began + total);
    let start = |i: usize, at: Instant| (i, at, Box::pin(configs[i].connect(tls.clone())));
    let mut started = Vec::with_capacity(count);
    started.extend(order.next().map(|i| start(i, began)));
    let mut next_at = began + share;
    loop {
        let more = order.len() > 0;
        if started.is_empty() && !more {
            return None;
        }
        tokio::select! {
            (i, result) = first_done(&mut started), if !started.is_empty() => match result {
                Ok((client, connection)) => {
                    // The servers still starting lost: said, so that a paused one is seen.
                    let now = Instant::now();
                    for (k, at, _) in started.drain(..) {
                        failed(&configs[k], Failure::Unanswered(now.duration_since(at)));
                    }
                    return Some((i, client, connection));
                }
                Err(e) => {
                    failed(&configs[i], Failure::Refused(e));
                    if started.is_empty() {
                        let now = Instant::now();
                        started.extend(order.next().map(|i| start(i, now)));
                        next_at = now + share;
                    }
                }
            },
            () = tokio::time::sleep_until(next_at), if more => {
                started.extend(order.next().map(|i| start(i, next_at)));
                next_at += share;
            }
            () = sleep_until_some(deadline), if deadline.is_some() => {
                let deadline = deadline.unwrap_or(began);
                for (i, at, _) in started.drain(..) {
                    failed(&configs[i], Failure::Unanswered(deadline.duration_since(at)));
                }
                for i in order {
                    failed(&configs[i], Failure::Unanswered(Duration::ZERO));
                }
                return None;
            }
        }
    }
}

/// The first of the started attempts to finish, taken out of `started`, with its server's
/// place; never finishes while `started` is empty.
async fn first_done<F, O>(started: &mut Vec<(usize, Instant, std::pin::Pin<Box<F>>)>) -> (usize, O)
where
    F: std::future::Future<Output = O>,
{
    std::future::poll_fn(|cx| {
        let done = started
            .iter_mut()
            .enumerate()
            .find_map(|(k, (_, _, attempt))| match attempt.as_mut().poll(cx) {
                std::task::Poll::Ready(result) => Some((k, result)),
                std::task::Poll::Pending => None,
            });
        match done {
            Some((k, result)) => {
                let (i, _, _) = started.swap_remove(k);
                std::task::Poll::Ready((i, result))
            }
            None => std::task::Poll::Pending,
        }
    })
    .await
}

async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// A connection of its own: the first of `config`'s servers to connect within
/// [`connect_limit`] ([`first_to_connect`]); each server that did not, logged once another
/// did. When none connects, what each did, in the order they were started.
pub(crate) async fn alone<T>(
    config: &Config,
    tls: T,
) -> Result<(Client, Connection<Socket, T::Stream>), Vec<(String, Failure)>>
where
    T: MakeTlsConnect<Socket> + Clone,
{
    let mut failed = Vec::new();
    let limit = connect_limit(config);
    let connected = first_to_connect(config, &tls, 0, Some(limit), &mut |server, failure| {
        failed.push((name(server), failure));
    })
    .await;
    match connected {
        Some((_, client, connection)) => {
            for (server, failure) in failed {
                tracing::warn!(
                    %server,
                    "a server database.url names did not connect ({failure}); another did"
                );
            }
            Ok((client, connection))
        }
        None => Err(failed),
    }
}

/// A pool's new connection: the first of `config`'s servers to connect
/// ([`first_to_connect`]), bounded by the pool's create timeout (`database.timeout_ms`). With
/// `target_session_attrs` asking for a server that takes writes, it starts with the server
/// that answered the pool's last new connection (`answered`); otherwise in the URL's order, as a
/// server that merely answered may be a standby. Each server that did not connect is logged.
pub(crate) async fn for_a_pool<T>(
    config: &Config,
    tls: T,
    answered: &LastAnswered,
) -> Result<(Client, Connection<Socket, T::Stream>), tokio_postgres::Error>
where
    T: MakeTlsConnect<Socket> + Clone,
{
    let remembered = config.get_target_session_attrs() != TargetSessionAttrs::Any
        && config.get_load_balance_hosts() != LoadBalanceHosts::Random;
    let first = if remembered {
        answered.0.load(Ordering::Relaxed)
    } else {
        0
    };
    let mut refused = None;
    let connected = first_to_connect(config, &tls, first, None, &mut |server, failure| {
        tracing::warn!(
            server = %name(server),
            "a server database.url names did not connect ({failure})"
        );
        if let Failure::Refused(e) = failure {
            refused = Some(e);
        }
    })
    .await;
    match (connected, refused) {
        (Some((i, client, connection)), _) => {
            if remembered {
                answered.0.store(i, Ordering::Relaxed);
            }
            Ok((client, connection))
        }
        (None, Some(e)) => Err(e),
        // Without a deadline every attempt ends refused or connected; tokio-postgres's own
        // attempt says what it says.
        (None, None) => config.connect(tls).await,
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Refused(e) => write!(f, "{}", crate::db::causes(e)),
            Failure::Unanswered(limit) => write!(
                f,
                "no connection within {} ms: it did not open the connection or did not answer \
                 its start-up",
                limit.as_millis()
            ),
        }
    }
}

/// A pool's sessions, made by [`for_a_pool`], each connection driven by a task of its own.
pub(crate) struct InTurn<T> {
    pub tls: T,
    pub answered: LastAnswered,
}

impl<T> deadpool_postgres::Connect for InTurn<T>
where
    T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
    T::Stream: Sync + Send,
    T::TlsConnect: Sync + Send,
    <T::TlsConnect as tokio_postgres::tls::TlsConnect<Socket>>::Future: Send,
{
    fn connect(
        &self,
        config: &Config,
    ) -> futures_util::future::BoxFuture<
        '_,
        Result<(Client, tokio::task::JoinHandle<()>), tokio_postgres::Error>,
    > {
        let config = config.clone();
        let tls = self.tls.clone();
        Box::pin(async move {
            let (client, connection) = for_a_pool(&config, tls, &self.answered).await?;
            let driver = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(error = %e, "database connection error");
                }
            });
            Ok((client, driver))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EVERYTHING: &str = "user=u password=p dbname=d options='-c a=b' \
        application_name=app sslmode=require connect_timeout=3 tcp_user_timeout=4 \
        keepalives=1 keepalives_idle=5 keepalives_interval=6 keepalives_retries=7 \
        target_session_attrs=read-write channel_binding=disable";

    #[test]
    fn a_server_of_many_keeps_every_other_setting() {
        let one: Config = format!("host=pg1 port=5433 {EVERYTHING}").parse().unwrap();
        assert!(
            one_per_server(&one) == [one.clone()],
            "one server: the configuration as it is"
        );
        let many: Config = format!("host=pg1,pg2,/run/pg port=5433,5434,5435 {EVERYTHING}")
            .parse()
            .unwrap();
        let each = one_per_server(&many);
        assert_eq!(each.len(), 3);
        let names: Vec<String> = each.iter().map(name).collect();
        assert_eq!(names, ["pg1:5433", "pg2:5434", "/run/pg:5435"]);
        // Each is the one-server configuration the same settings would parse to.
        let alone: Config = format!("host=pg2 port=5434 {EVERYTHING}").parse().unwrap();
        assert!(each[1] == alone, "every setting but the server's is kept");
    }

    #[test]
    fn one_port_serves_every_server_and_addresses_stay_with_their_hosts() {
        let many: Config = "host=pg1,pg2 hostaddr=127.0.0.2,127.0.0.3 port=6000 user=u"
            .parse()
            .unwrap();
        let each = one_per_server(&many);
        let addrs: Vec<_> = each.iter().map(|c| c.get_hostaddrs().to_vec()).collect();
        assert_eq!(
            addrs,
            [
                vec!["127.0.0.2".parse::<std::net::IpAddr>().unwrap()],
                vec!["127.0.0.3".parse().unwrap()]
            ]
        );
        assert!(each.iter().all(|c| c.get_ports() == [6000]));
        assert_eq!(servers(&many), 2);
    }

    #[test]
    fn random_order_tries_every_server_once() {
        let many: Config = "host=a,b,c,d,e user=u load_balance_hosts=random"
            .parse()
            .unwrap();
        let mut names: Vec<String> = one_per_server(&many).iter().map(name).collect();
        names.sort();
        assert_eq!(names, ["a:5432", "b:5432", "c:5432", "d:5432", "e:5432"]);
    }
}
