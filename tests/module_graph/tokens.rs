//! The module graph's reading of Rust source: tokens without comments and literals, test
//! items dropped, and the paths of a `use` tree.

#[derive(Debug, Clone, PartialEq)]
pub enum Tok {
    Ident(String),
    /// `::`
    Path,
    Punct(char),
}

/// Source text without comments, string and char literals, as tokens with their line numbers.
pub fn tokens(text: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = text.chars().collect();
    let mut out: Vec<(Tok, usize)> = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < c.len() {
        let ch = c[i];
        let next = c.get(i + 1).copied();
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch == '/' && next == Some('/') {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && next == Some('*') {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    line += usize::from(c[i] == '\n');
                    i += 1;
                }
            }
        } else if ch == 'r' && (next == Some('"') || (next == Some('#') && raw_string_at(&c, i))) {
            // r"..." or r#"..."#
            let mut j = i + 1;
            let mut hashes = 0;
            while c.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            j += 1;
            loop {
                match c.get(j) {
                    None => break,
                    Some('"') if (1..=hashes).all(|k| c.get(j + k) == Some(&'#')) => {
                        j += 1 + hashes;
                        break;
                    }
                    Some(x) => {
                        line += usize::from(*x == '\n');
                        j += 1;
                    }
                }
            }
            i = j;
        } else if ch == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                if c[i] == '\\' {
                    i += 1;
                }
                line += usize::from(c.get(i) == Some(&'\n'));
                i += 1;
            }
            i += 1;
        } else if ch == '\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if next == Some('\\') {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if c.get(i + 2) == Some(&'\'') {
                i += 3;
            } else {
                i += 1;
            }
        } else if ch == ':' && next == Some(':') {
            out.push((Tok::Path, line));
            i += 2;
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push((Tok::Ident(c[start..i].iter().collect()), line));
        } else {
            if !ch.is_whitespace() {
                out.push((Tok::Punct(ch), line));
            }
            i += 1;
        }
    }
    out
}

fn raw_string_at(c: &[char], i: usize) -> bool {
    let mut j = i + 1;
    while c.get(j) == Some(&'#') {
        j += 1;
    }
    c.get(j) == Some(&'"')
}

pub fn ident(t: Option<&(Tok, usize)>) -> Option<&str> {
    match t {
        Some((Tok::Ident(s), _)) => Some(s),
        _ => None,
    }
}

/// Drops every item under `#[cfg(test)]` or `#[cfg(all(test, ...))]`.
pub fn without_test_items(t: Vec<(Tok, usize)>) -> Vec<(Tok, usize)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        let is_test_attr = t[i].0 == Tok::Punct('#')
            && t.get(i + 1).map(|x| &x.0) == Some(&Tok::Punct('['))
            && ident(t.get(i + 2)) == Some("cfg")
            && (ident(t.get(i + 4)) == Some("test")
                || (ident(t.get(i + 4)) == Some("all") && ident(t.get(i + 6)) == Some("test")));
        if !is_test_attr {
            out.push(t[i].clone());
            i += 1;
            continue;
        }
        // Skip the attribute, then the item: up to its `;` or through its braces.
        while i < t.len() && t[i].0 != Tok::Punct(']') {
            i += 1;
        }
        i += 1;
        let mut depth = 0;
        while i < t.len() {
            match t[i].0 {
                Tok::Punct('{') => depth += 1,
                Tok::Punct('}') => {
                    depth -= 1;
                    if depth == 0 {
                        i += 1;
                        break;
                    }
                }
                Tok::Punct(';') if depth == 0 => {
                    i += 1;
                    break;
                }
                _ => {}
            }
            i += 1;
        }
    }
    out
}

/// The paths of a `use` tree starting at `t[*i]`, each with the name it binds.
pub fn use_tree(
    t: &[(Tok, usize)],
    i: &mut usize,
    prefix: &[String],
    out: &mut Vec<(Vec<String>, String)>,
) {
    let mut path = prefix.to_vec();
    loop {
        match t.get(*i).map(|x| &x.0) {
            Some(Tok::Ident(s)) if s == "as" => {
                *i += 1;
                let alias = ident(t.get(*i)).unwrap_or("_").to_string();
                *i += 1;
                out.push((path, alias));
                return;
            }
            Some(Tok::Ident(s)) => {
                path.push(s.clone());
                *i += 1;
            }
            Some(Tok::Path) => *i += 1,
            Some(Tok::Punct('{')) => {
                *i += 1;
                loop {
                    match t.get(*i).map(|x| &x.0) {
                        Some(Tok::Punct('}')) => {
                            *i += 1;
                            return;
                        }
                        Some(Tok::Punct(',')) => *i += 1,
                        None => return,
                        _ => use_tree(t, i, &path, out),
                    }
                }
            }
            Some(Tok::Punct('*')) => {
                *i += 1;
                out.push((path, "*".into()));
                return;
            }
            _ => {
                let name = path.last().cloned().unwrap_or_default();
                if name == "self" {
                    path.pop();
                    let bound = path.last().cloned().unwrap_or_default();
                    out.push((path, bound));
                } else {
                    out.push((path, name));
                }
                return;
            }
        }
    }
}
