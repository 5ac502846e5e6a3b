//! The servers a `database.url` names, tried one at a time, each within a limit of its own.
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
//! session. Either way the server that took over is never tried. So railguard splits the URL
//! into one configuration per server, gives each an equal share of the connect timeout
//! (`database.timeout_ms`: a connection is still opened, or given up on, within it), and a
//! pool tries first the server that answered its last new session, so that only the first
//! session after a change of server pays for the ones that do not answer.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio_postgres::config::{Host, LoadBalanceHosts};
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{Client, Config, Connection, Socket};

/// How long one connection may take to open and answer its start-up, whatever servers it
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
    Unanswered(Duration),
}

/// Which of a URL's servers answered a pool's last new session: the next one tries it first.
#[derive(Clone, Default)]
pub(crate) struct LastAnswered(Arc<AtomicUsize>);

/// Tries each of `config`'s servers but the last in turn, from `first` on (wrapping), each
/// within its share of [`connect_limit`]: the first that connects (and its place in
/// [`one_per_server`]'s order), or else the last server's configuration, for the caller to try
/// within what is left. `failed` hears each server that did not connect.
async fn all_but_the_last<T>(
    config: &Config,
    tls: &T,
    first: usize,
    mut failed: impl FnMut(&Config, Failure),
) -> Result<(usize, Client, Connection<Socket, T::Stream>), (usize, Config)>
where
    T: MakeTlsConnect<Socket> + Clone,
{
    let share = share(config);
    let configs = one_per_server(config);
    let count = configs.len();
    let mut order = (0..count).map(|i| (first + i) % count);
    let last = order.next_back().unwrap_or(0);
    for i in order {
        let one = &configs[i];
        match tokio::time::timeout(share, one.connect(tls.clone())).await {
            Ok(Ok((client, connection))) => return Ok((i, client, connection)),
            Ok(Err(e)) => failed(one, Failure::Refused(e)),
            Err(_) => failed(one, Failure::Unanswered(share)),
        }
    }
    let last_config = configs
        .into_iter()
        .nth(last)
        .unwrap_or_else(|| config.clone());
    Err((last, last_config))
}

/// A connection of its own: each server in turn, the last too within its share of
/// [`connect_limit`]; when none connects, what each did, in the order they were tried.
pub(crate) async fn alone<T>(
    config: &Config,
    tls: T,
) -> Result<(Client, Connection<Socket, T::Stream>), Vec<(String, Failure)>>
where
    T: MakeTlsConnect<Socket> + Clone,
{
    let mut failed = Vec::new();
    let (_, last) = match all_but_the_last(config, &tls, 0, |server, failure| {
        failed.push((name(server), failure));
    })
    .await
    {
        Ok((_, client, connection)) => return Ok((client, connection)),
        Err(last) => last,
    };
    let share = share(config);
    let failure = match tokio::time::timeout(share, last.connect(tls)).await {
        Ok(Ok(connected)) => return Ok(connected),
        Ok(Err(e)) => Failure::Refused(e),
        Err(_) => Failure::Unanswered(share),
    };
    failed.push((name(&last), failure));
    Err(failed)
}

/// A pool's new session: the server that answered the pool's last one first, then the others
/// in turn, each but the last within its share of [`connect_limit`], the last within what is
/// left of the pool's create timeout (which `db` sets to that limit); each server that did
/// not connect is logged.
pub(crate) async fn for_a_pool<T>(
    config: &Config,
    tls: T,
    answered: &LastAnswered,
) -> Result<(Client, Connection<Socket, T::Stream>), tokio_postgres::Error>
where
    T: MakeTlsConnect<Socket> + Clone,
{
    let first = match config.get_load_balance_hosts() {
        LoadBalanceHosts::Random => 0,
        _ => answered.0.load(Ordering::Relaxed),
    };
    let warn = |server: &Config, failure: Failure| {
        tracing::warn!(
            server = %name(server),
            "a server database.url names did not connect ({failure}); trying the next"
        );
    };
    let (i, client, connection) = match all_but_the_last(config, &tls, first, warn).await {
        Ok(connected) => connected,
        Err((i, last)) => {
            let (client, connection) = last.connect(tls).await?;
            (i, client, connection)
        }
    };
    answered.0.store(i, Ordering::Relaxed);
    Ok((client, connection))
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
