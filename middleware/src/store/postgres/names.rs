//! Schema, table and column names: validated, because they cannot be bound parameters.

use std::fmt;

use crate::error::ConfigError;

/// A plain SQL identifier: 1 to 63 lowercase ASCII letters, digits and underscores, not
/// starting with a digit. Shown double-quoted, ready for SQL.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Ident(String);

impl Ident {
    /// Validates `name`; [`ConfigError::InvalidIdentifier`] if it is not a plain identifier.
    pub fn new(name: impl Into<String>) -> Result<Self, ConfigError> {
        let name = name.into();
        if crate::store::sql::is_plain_name(&name, 63) {
            Ok(Ident(name))
        } else {
            Err(ConfigError::InvalidIdentifier { identifier: name })
        }
    }

    /// The name, unquoted.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "\"{}\"", self.0)
    }
}

/// A table in a schema, e.g. `oncely.consumption_record`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Table {
    schema: Ident,
    name: Ident,
}

impl Table {
    /// `schema.name`, both validated with [`Ident::new`].
    pub fn new(schema: &str, name: &str) -> Result<Self, ConfigError> {
        Ok(Table {
            schema: Ident::new(schema)?,
            name: Ident::new(name)?,
        })
    }

    /// The schema.
    pub fn schema(&self) -> &Ident {
        &self.schema
    }

    /// The table's own name.
    pub fn name(&self) -> &Ident {
        &self.name
    }

    pub(super) fn render(&self, migration: &str) -> String {
        migration
            .replace("{schema}", &self.schema.to_string())
            .replace("{table}", &self.name.to_string())
            .replace(
                "{processing_lease_index}",
                &format!("\"{}_processing_lease\"", self.name.as_str()),
            )
            .replace(
                "{success_updated_index}",
                &format!("\"{}_success_updated\"", self.name.as_str()),
            )
    }
}

/// Where oncely-http keeps the stored responses of the record table `records`:
/// `<records>_responses`, in the same schema. The record's retention and the operator's
/// `purge` keep a record row while its response there still lives, and remove the two
/// together once it expired: a record row gone before its response would let the key run
/// again. [`ConfigError::InvalidIdentifier`] when the name is longer than 63 bytes.
pub fn responses_table(records: &Table) -> Result<Table, ConfigError> {
    Table::new(
        records.schema.as_str(),
        &format!("{}_responses", records.name.as_str()),
    )
}

impl fmt::Display for Table {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_validated_and_quoted() {
        assert_eq!(
            Ident::new("consumption_record").unwrap().to_string(),
            "\"consumption_record\""
        );
        for bad in [
            "",
            "1abc",
            "Orders",
            "a-b",
            "a\"b",
            "x; DROP TABLE y",
            &"a".repeat(64),
        ] {
            assert!(
                matches!(Ident::new(bad), Err(ConfigError::InvalidIdentifier { .. })),
                "{bad}"
            );
        }
        let table = Table::new("shop", "orders").unwrap();
        assert_eq!(table.to_string(), "\"shop\".\"orders\"");
    }
}
