//! MySQL and MariaDB for the tests: the server on `MYSQL_URL`, and a database of each
//! test's own.

use oncely::mysql::sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use oncely::mysql::sqlx::{self, MySqlPool};

/// The MySQL or MariaDB the tests use: `MYSQL_URL`, or `mysql://root@127.0.0.1:3306/test`.
pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL").unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".into())
}

/// A database no other test uses (`oncely_test_…`, left behind: its name is unique, so
/// reruns do not see each other's rows), and a pool of up to `size` connections to it.
pub async fn scratch_database(size: u32) -> MySqlPool {
    let admin: MySqlConnectOptions = mysql_url().parse().expect("a valid MYSQL_URL");
    let name = format!("oncely_test_{}", oncely::Token::random());
    let admin = MySqlPool::connect_with(admin).await.unwrap_or_else(|error| {
        panic!("MySQL at MYSQL_URL ({error}); run integration-tests/services.sh mariadb")
    });
    sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
        .execute(&admin)
        .await
        .expect("create the test's database");
    admin.close().await;
    pool_on(&name, size, None).await
}

/// A pool of up to `size` connections to `database` on `MYSQL_URL`, in the session time zone
/// `time_zone` (sqlx's default, UTC, if none).
pub async fn pool_on(database: &str, size: u32, time_zone: Option<&str>) -> MySqlPool {
    let options: MySqlConnectOptions = mysql_url().parse().expect("a valid MYSQL_URL");
    let options = match time_zone {
        Some(zone) => options.timezone(Some(zone.to_owned())),
        None => options,
    };
    MySqlPoolOptions::new()
        .max_connections(size)
        .connect_with(options.database(database))
        .await
        .expect("a pool on the test's database")
}
