//! One test world: PostgreSQL (always: it holds the rail's marks), etcd when the lock backend
//! is etcd, the rail simulator, and one railguard serving from the chosen backend — plus the
//! backend-neutral faults a behavioural case needs (restart, stop, start the backend).
//!
//! A case is an `async fn(World)`; [`suite!`](crate::suite) instantiates a list of cases once
//! per backend, so every backend must pass the same cases unchanged.

use std::time::Duration;

use railguard_sdk::LockClient;

use crate::{EtcdCluster, Pg, Rail, Railguard, Relay, init_tracing};

/// Which backend a world runs.
#[derive(Debug, Clone, Copy)]
pub enum Backend {
    Postgres,
    Etcd,
}

/// PostgreSQL (always: it holds the rail's marks), etcd for the etcd backend, and one
/// railguard serving the lock API from the chosen backend.
pub struct World {
    pub backend: Backend,
    pub pg: Pg,
    pub etcd: Option<EtcdCluster>,
    pub rail: Rail,
    pub rg: Railguard,
}

impl World {
    pub async fn start(backend: Backend, env: &[(&str, &str)]) -> World {
        let etcd = match backend {
            Backend::Postgres => None,
            Backend::Etcd => Some(EtcdCluster::single().await),
        };
        Self::start_with(backend, etcd, env).await
    }

    /// PostgreSQL, the rail simulator and a railguard in this process with `env`: the
    /// proxy's everyday world, on the PostgreSQL lock backend.
    pub async fn postgres(env: &[(&str, &str)]) -> World {
        Self::start(Backend::Postgres, env).await
    }

    /// [`World::postgres`] with `rail` (a slow one, say) as the rail.
    pub async fn postgres_on(rail: Rail, env: &[(&str, &str)]) -> World {
        Self::postgres_with(rail, env, false).await
    }

    /// [`World::postgres_on`] with railguard as a child process: for a test that stops,
    /// kills or signals it, or reads its log.
    pub async fn postgres_process(rail: Rail, env: &[(&str, &str)]) -> World {
        Self::postgres_with(rail, env, true).await
    }

    /// [`World::postgres`] whose railguard reaches the rail through a [`Relay`]: the slow
    /// network path a test delays or stalls.
    pub async fn postgres_via_relay(env: &[(&str, &str)]) -> (World, Relay) {
        let rail = Rail::start().await;
        let relay = Relay::start(rail.addr).await;
        let url = relay.url();
        (
            Self::postgres_with_upstream(rail, &url, env, false).await,
            relay,
        )
    }

    /// [`World::postgres_via_relay`] with railguard as a child process.
    pub async fn postgres_process_via_relay(env: &[(&str, &str)]) -> (World, Relay) {
        let rail = Rail::start().await;
        let relay = Relay::start(rail.addr).await;
        let url = relay.url();
        (
            Self::postgres_with_upstream(rail, &url, env, true).await,
            relay,
        )
    }

    async fn postgres_with(rail: Rail, env: &[(&str, &str)], process: bool) -> World {
        let url = rail.url();
        Self::postgres_with_upstream(rail, &url, env, process).await
    }

    async fn postgres_with_upstream(
        rail: Rail,
        upstream: &str,
        env: &[(&str, &str)],
        process: bool,
    ) -> World {
        init_tracing();
        let pg = Pg::start().await;
        let rg = if process {
            Railguard::start_process(&pg.url(), upstream, env).await
        } else {
            Railguard::start(&pg.url(), upstream, env).await
        };
        World {
            backend: Backend::Postgres,
            pg,
            etcd: None,
            rail,
            rg,
        }
    }

    pub async fn start_with(
        backend: Backend,
        etcd: Option<EtcdCluster>,
        env: &[(&str, &str)],
    ) -> World {
        init_tracing();
        let pg = Pg::start().await;
        let rail = Rail::start().await;
        let mut env: Vec<(&str, &str)> = env.to_vec();
        let endpoints = etcd.as_ref().map(|e| e.endpoints_csv()).unwrap_or_default();
        if etcd.is_some() {
            env.push(("RAILGUARD__LOCK__BACKEND", "etcd"));
            env.push(("RAILGUARD__ETCD__ENDPOINTS", &endpoints));
            env.push(("RAILGUARD__ETCD__REQUEST_TIMEOUT_MS", "1000"));
            env.push(("RAILGUARD__ETCD__DIAL_TIMEOUT_MS", "1000"));
        }
        let rg = Railguard::start(&pg.url(), &rail.url(), &env).await;
        World {
            backend,
            pg,
            etcd,
            rail,
            rg,
        }
    }

    /// A PostgreSQL world's parts, for a test that names them (`let (pg, rail, rg) = …`).
    pub fn parts(self) -> (Pg, Rail, Railguard) {
        assert!(
            self.etcd.is_none(),
            "an etcd world's etcd would stop with its parts"
        );
        (self.pg, self.rail, self.rg)
    }

    pub fn client(&self) -> LockClient {
        self.rg.lock_client()
    }

    /// A second railguard on the same backend (and the same PostgreSQL).
    pub async fn another_railguard(&self, env: &[(&str, &str)]) -> Railguard {
        let mut env: Vec<(&str, &str)> = env.to_vec();
        let endpoints = self
            .etcd
            .as_ref()
            .map(|e| e.endpoints_csv())
            .unwrap_or_default();
        if self.etcd.is_some() {
            env.push(("RAILGUARD__LOCK__BACKEND", "etcd"));
            env.push(("RAILGUARD__ETCD__ENDPOINTS", &endpoints));
        }
        Railguard::start(&self.pg.url(), &self.rail.url(), &env).await
    }

    /// The shortest lease the backend grants as asked: etcd leases are whole seconds.
    pub fn short_ttl(&self) -> Duration {
        match self.backend {
            Backend::Postgres => Duration::from_millis(100),
            Backend::Etcd => Duration::from_secs(1),
        }
    }

    pub fn etcd(&self) -> &EtcdCluster {
        self.etcd.as_ref().expect("an etcd world")
    }

    /// Restarts whatever holds the grants, keeping its data.
    pub async fn restart_backend(&mut self) {
        match self.backend {
            Backend::Postgres => {
                self.pg.server.stop().await;
                self.pg.server.start().await.expect("postgres restarts");
            }
            Backend::Etcd => {
                let etcd = self.etcd.as_mut().unwrap();
                etcd.stop(0).await;
                etcd.start(0).await;
            }
        }
    }

    pub async fn start_backend(&mut self) {
        match self.backend {
            Backend::Postgres => self.pg.server.start().await.expect("postgres starts"),
            Backend::Etcd => self.etcd.as_mut().unwrap().start(0).await,
        }
    }

    pub async fn stop_backend(&mut self) {
        match self.backend {
            Backend::Postgres => self.pg.kill().await,
            Backend::Etcd => self.etcd.as_mut().unwrap().kill(0).await,
        }
    }
}

/// Instantiates behavioural cases once per backend: for each `module => backend`, a module
/// with one `#[tokio::test]` per `name => case` (optionally `with ENV`, the extra
/// `RAILGUARD__…` overrides that case's world needs), each running `case(world)` on a fresh
/// [`World`] of that backend.
///
/// ```ignore
/// railguard_testkit::suite!([postgres => Backend::Postgres, etcd => Backend::Etcd] {
///     tokens_increase => inv04_tokens_strictly_increase,
///     woken_by_release => a_waiter_is_woken_by_release with SLOW_POLL,
/// });
/// ```
#[macro_export]
macro_rules! suite {
    ([$($module:ident => $backend:expr),+ $(,)?] $cases:tt) => {
        $( $crate::suite!(@module $module, $backend, $cases); )+
    };
    (@module $module:ident, $backend:expr, {
        $( $name:ident => $case:ident $(with $env:expr)? ),* $(,)?
    }) => {
        mod $module {
            use super::*;
            $(
                #[tokio::test]
                async fn $name() {
                    let env: &[(&str, &str)] = &[];
                    $( let env: &[(&str, &str)] = $env; )?
                    $case($crate::World::start($backend, env).await).await
                }
            )*
        }
    };
}
